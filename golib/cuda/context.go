package cuda

import (
	"fmt"
	"runtime"
)

// PrimaryContext retains and returns the primary context of the GPU with
// the given ordinal: the one torch's runtime uses. The retain is never
// released; the context lives as long as the process, as torch's does.
func (d *Driver) PrimaryContext(ordinal int) (Context, error) {
	d.ctxMu.Lock()
	defer d.ctxMu.Unlock()
	if c, ok := d.primary[ordinal]; ok {
		return c, nil
	}
	dev, err := d.Device(ordinal)
	if err != nil {
		return 0, err
	}
	c, err := d.retainPrimary(dev)
	if err != nil {
		return 0, fmt.Errorf("GPU %d: %w", ordinal, err)
	}
	d.primary[ordinal] = c
	return c, nil
}

// RetainedPrimary is the device's primary context if PrimaryContext
// retained it, else 0. It creates nothing.
func (d *Driver) RetainedPrimary(ordinal int) Context {
	d.ctxMu.Lock()
	defer d.ctxMu.Unlock()
	return d.primary[ordinal]
}

// EnsureContext makes the calling thread's current context one on the GPU
// with the given ordinal. A thread that already has such a context (torch's,
// on the Python thread) is left alone; otherwise the device's primary context
// is made current, which is the context torch's runtime uses too.
//
// Call it from exported functions before any driver call. A goroutine must
// hold runtime.LockOSThread across EnsureContext and the calls that rely on
// it; WithContext does both.
func (d *Driver) EnsureContext(ordinal int) error {
	cur, err := d.CurrentContext()
	if err != nil {
		return err
	}
	// The usual case, torch's thread on the primary context we retained:
	// one driver call instead of three.
	if cur != 0 && cur == d.RetainedPrimary(ordinal) {
		return nil
	}
	if cur != 0 {
		dev, err := d.ContextDevice()
		if err != nil {
			return err
		}
		want, err := d.Device(ordinal)
		if err != nil {
			return err
		}
		if dev == want {
			// Torch's context is normally the device's primary one: learn
			// its handle for the fast path (it exists, so retaining it
			// creates nothing).
			if d.primaryActive(want) {
				_, _ = d.PrimaryContext(ordinal)
			}
			return nil
		}
	}
	ctx, err := d.PrimaryContext(ordinal)
	if err != nil {
		return err
	}
	return d.SetCurrentContext(ctx)
}

// WithContext runs f on a locked OS thread whose current context is ctx,
// then restores the thread's previous context. Use it for goroutines that
// call the driver: the current context belongs to the OS thread, and an
// unlocked goroutine may move between threads at any call.
func (d *Driver) WithContext(ctx Context, f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	prev, err := d.CurrentContext()
	if err != nil {
		return err
	}
	if prev != ctx {
		if err := d.SetCurrentContext(ctx); err != nil {
			return err
		}
		defer func() { _ = d.SetCurrentContext(prev) }()
	}
	return f()
}
