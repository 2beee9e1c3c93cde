// Package status defines the status codes that cross the C ABI and the error
// type that carries one through Go code.
package status

import (
	"errors"
	"fmt"
)

// Code is a status returned by every exported C function. The numbers are
// part of the ABI: python/p2pcomm/errors.py mirrors them.
type Code int32

const (
	OK              Code = 0
	InvalidArgument Code = 1  // bad shape, pointer, size, handle, enum value
	Unsupported     Code = 2  // dtype, op or algorithm this backend cannot do
	Capacity        Code = 3  // larger than the registered or staging capacity
	State           Code = 4  // used before init or after close
	Mismatch        Code = 5  // ranks called with different arguments
	Timeout         Code = 6  // a peer never arrived within the timeout
	Bootstrap       Code = 7  // rendezvous failed
	CUDA            Code = 8  // a CUDA driver or NVRTC call failed
	Fork            Code = 9  // called from a forked child
	Internal        Code = 10 // a bug: a recovered panic or broken invariant
	PeerUnavailable Code = 11 // no P2P access between two GPUs
)

var names = map[Code]string{
	OK: "ok", InvalidArgument: "invalid argument", Unsupported: "unsupported",
	Capacity: "capacity exceeded", State: "invalid state", Mismatch: "mismatch across ranks",
	Timeout: "timeout", Bootstrap: "bootstrap failed", CUDA: "CUDA error", Fork: "forked child",
	Internal: "internal error", PeerUnavailable: "peer unavailable",
}

func (c Code) String() string {
	if n, ok := names[c]; ok {
		return n
	}
	return fmt.Sprintf("status(%d)", int32(c))
}

// Error is an error with a status code. Wrap it with fmt.Errorf("...: %w")
// freely: CodeOf finds the code through the chain.
type Error struct {
	Code Code
	Msg  string
}

func (e *Error) Error() string { return e.Msg }

// Errorf returns an *Error with the given code and a formatted message.
func Errorf(code Code, format string, args ...any) error {
	return &Error{Code: code, Msg: fmt.Sprintf(format, args...)}
}

// CodeOf returns the status code carried by err: OK for nil, Internal for an
// error that carries none.
func CodeOf(err error) Code {
	if err == nil {
		return OK
	}
	var se *Error
	if errors.As(err, &se) {
		return se.Code
	}
	var coded interface{ StatusCode() Code }
	if errors.As(err, &coded) {
		return coded.StatusCode()
	}
	return Internal
}
