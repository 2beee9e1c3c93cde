package comm

import (
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/cuda"
	"github.com/p2pcomm/p2pcomm/golib/gpucoll"
	"github.com/p2pcomm/p2pcomm/golib/hostcoll"
	"github.com/p2pcomm/p2pcomm/golib/moe"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// moeGPU is the GPU backend as golib/moe uses it: the backend's memory,
// barriers and kernels, and the CUDA driver on its device.
type moeGPU struct {
	*gpucoll.Backend
	*cuda.Driver
}

var _ moe.GPU = moeGPU{}

// EnsureContext makes the backend's device current on the calling thread.
func (g moeGPU) EnsureContext() error { return g.Driver.EnsureContext(g.Backend.Device()) }

// stagedHostStaging is the staging area of the host backend an EP across
// nodes makes: its path keeps everything in its own allocations.
const stagedHostStaging = 64 << 10

// NewMoE builds an expert-parallel engine over this communicator's
// backend. Collective (see moe.NewGPU); on GPUs of several nodes, see
// moe.NewStaged.
func (c *Comm) NewMoE(cfg moe.Config) (*moe.EP, error) {
	var ep *moe.EP
	err := c.Do(func(b collective.Backend) error {
		var err error
		switch be := b.(type) {
		case *gpucoll.Backend:
			if !c.topo.MultiNode() {
				ep, err = moe.NewGPU(c.bs, moeGPU{be, be.Driver()}, cfg)
				break
			}
			// Across nodes the rows go through host memory on the host
			// path, over a host backend of the same ranks for this EP.
			var host *hostcoll.Comm
			if host, err = hostcoll.New(c.bs, hostcoll.Options{Job: c.job, StagingBytes: stagedHostStaging,
				Timeout: c.timeout, Topology: c.topo, NetRails: be.NetRails()}); err == nil {
				ep, err = moe.NewStaged(c.bs, host, moeGPU{be, be.Driver()}, cfg)
			}
		case *hostcoll.Comm:
			ep, err = moe.NewCPU(c.bs, be, cfg)
		default:
			err = status.Errorf(status.Unsupported, "ExpertParallel needs a backend with peer memory")
		}
		return err
	})
	return ep, err
}
