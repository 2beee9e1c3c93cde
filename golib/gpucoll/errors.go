package gpucoll

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Error codes of ErrorWord (p2p_common.cuh ErrCode).
const (
	errTimeout   = 1
	errBadParams = 2
	errHostAbort = 3
	errMismatch  = 4
	errProxy     = 5 // kErrProxy: the proxy failed a trigger of a PortChannel's FIFO
)

// phaseNames: the waits of p2p_common.cuh's Phase, then kPhaseData (LL
// kernels waiting for a peer's data lines), then kPhaseMoeStart and
// kPhaseMoeMid (moe.cu's in-kernel barriers; the step says which call).
var phaseNames = []string{"start barrier", "middle barrier", "end barrier", "step barrier", "data exchange",
	"start barrier", "middle barrier"}

const (
	phaseMoeStart    = 5
	phaseMoeMid      = 6
	phaseChannelWait = 7 // channel.cuh kPhaseChannelWait: a semaphore wait
	phaseFifoPush    = 8 // kPhaseFifoPush: a push waiting for a free FIFO slot (step = FIFO id)
	phaseFifoFlush   = 9 // kPhaseFifoFlush: a flush waiting for the proxy (step = FIFO id)
	// allreduce_hier.cu: the nodes' header exchange (mismatches), and a
	// block's wait for block 0's verdict on it.
	phaseHierHeader  = 10
	phaseHierVerdict = 11
)

func phaseName(p int32) string {
	switch {
	case p >= 0 && int(p) < len(phaseNames):
		return phaseNames[p]
	case p == phaseHierHeader:
		return "header exchange across nodes"
	case p == phaseHierVerdict:
		return "verdict of the header exchange across nodes"
	}
	return "barrier"
}

// moePhase: the wait was one of moe.cu's in-kernel barriers.
func moePhase(e errorWord) bool { return e.Phase == phaseMoeStart || e.Phase == phaseMoeMid }

// callName is the collective whose wait timed out.
func callName(e errorWord) string {
	if !moePhase(e) {
		// Barriers report step = -1 - the call they serve (kCallShift).
		if call := collective.Call(-1 - e.Step); e.Step < 0 && call.Valid() {
			return call.String()
		}
		return "an all-reduce"
	}
	if e.Step == 0 {
		return "an MoE dispatch"
	}
	return "an MoE combine"
}

// describeChannel turns what a channel wait recorded into an error naming
// the peer, or returns nil for the waits of collectives.
func describeChannel(e errorWord) error {
	const cannot = "the communicator cannot continue (P2PCOMM_TIMEOUT_MS)"
	switch {
	case e.Code == errProxy && (e.Phase == phaseFifoPush || e.Phase == phaseFifoFlush):
		what := "push"
		if e.Phase == phaseFifoFlush {
			what = "flush"
		}
		return status.Errorf(status.Internal,
			"the proxy failed a trigger of FIFO %d toward peer %d, seen by a %s on rank %d (block %d); the proxy's error says why (port channels)",
			e.Step, e.Peer, what, e.Rank, e.Block)
	case e.Code == errProxy && e.Phase == phaseChannelWait:
		return status.Errorf(status.Internal,
			"the proxy of rank %d failed (FIFO %d) while a channel wait for a signal from peer %d was pending (block %d, waited for count %d, saw %d); the proxy's error says why (port channels)",
			e.Rank, e.Step, e.Peer, e.Block, e.Expected, e.Seen)
	case e.Code != errTimeout:
		return nil
	case e.Phase == phaseChannelWait:
		return status.Errorf(status.Timeout,
			"rank %d's channel wait for a signal from peer %d timed out (block %d, waited for count %d, saw %d); %s",
			e.Rank, e.Peer, e.Block, e.Expected, e.Seen, cannot)
	case e.Phase == phaseFifoPush:
		return status.Errorf(status.Timeout,
			"rank %d's push into FIFO %d toward peer %d found no free slot (block %d, waited for the proxy to pass position %d, it was at %d): the proxy is stalled; %s",
			e.Rank, e.Step, e.Peer, e.Block, e.Expected, e.Seen, cannot)
	case e.Phase == phaseFifoFlush:
		return status.Errorf(status.Timeout,
			"rank %d's flush of FIFO %d toward peer %d timed out (block %d, waited for the proxy to complete %d triggers, it had %d); %s",
			e.Rank, e.Step, e.Peer, e.Block, e.Expected, e.Seen, cannot)
	}
	return nil
}

// describe turns what a kernel recorded into an error naming the peer.
func describe(e errorWord) error {
	if err := describeChannel(e); err != nil {
		return err
	}
	switch e.Code {
	case errTimeout:
		where := fmt.Sprintf("block %d, step %d", e.Block, e.Step)
		if moePhase(e) || e.Step < 0 {
			where = fmt.Sprintf("block %d", e.Block)
		}
		return status.Errorf(status.Timeout,
			"rank %d never arrived at the %s of %s (%s, waited for flag %d, saw %d); the communicator cannot continue (P2PCOMM_TIMEOUT_MS)",
			e.Peer, phaseName(e.Phase), callName(e), where, e.Expected, e.Seen)
	case errMismatch:
		return status.Errorf(status.Mismatch,
			"ranks disagree: rank %d called all-reduce with different arguments (size, dtype, op, algorithm, or a registered input read in place at another offset or on some ranks only) or rejected its own; nothing was reduced",
			e.Peer)
	case errBadParams:
		if e.Step > 0 {
			return status.Errorf(status.Internal, "kernel rejected its parameters on rank %d (block %d, check %d)", e.Rank, e.Block, e.Step)
		}
		return status.Errorf(status.Internal, "kernel rejected its parameters on rank %d (block %d)", e.Rank, e.Block)
	}
	return status.Errorf(status.Internal, "kernel reported error code %d (peer %d, phase %d)", e.Code, e.Peer, e.Phase)
}
