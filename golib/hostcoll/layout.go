package hostcoll

import (
	"sync/atomic"
	"unsafe"
)

// Each rank owns one segment: a control block followed by its staging area.
// The control block is written only by its owner and read by peers, so no
// two processes ever write the same cache line.
const (
	lineBytes    = 128
	ctlBytes     = 16 * lineBytes
	offPid       = 0 * lineBytes
	offArrive    = 1 * lineBytes // seq of the last call whose input is ready
	offReduced   = 2 * lineBytes // seq of the last call whose own slice is reduced
	offDone      = 3 * lineBytes // seq of the last call this rank no longer reads peers in
	offDesc      = 4 * lineBytes // two descriptors, indexed by seq parity
	offAbortVer  = 6 * lineBytes // versions of this rank's failure record (across nodes)
	offAbortRec  = 8 * lineBytes // two failure records, indexed by version parity
	stagingAlign = 4096
)

// Two descriptor slots alternate by parity: a rank can be at most one call
// ahead of a slow peer still reading the previous call's descriptor.
type descriptor struct {
	Seq       uint64
	Kind      uint32
	DType     int32
	Op        int32
	Algo      int32
	Count     int64
	Input     int64 // symmetric allocation id holding the input, or -1 when staged
	InOffset  int64
	ResultIn  int32 // where this rank leaves its reduced slice: resultStaging or resultInput
	LocalErr  int32 // status code of a local validation failure, 0 if none
	ErrDetail [56]byte
}

const (
	kindAllReduce = 1
	kindBarrier   = 2

	resultStaging = 0
	resultInput   = 1
)

var _ [lineBytes - unsafe.Sizeof(descriptor{})]byte // a descriptor fits in one line

type ctlView struct{ base unsafe.Pointer }

func (v ctlView) word(off int) *uint64 { return (*uint64)(unsafe.Add(v.base, off)) }

func (v ctlView) load(off int) uint64 { return atomic.LoadUint64(v.word(off)) }

// store publishes with release semantics: everything written before it
// (staged input, descriptor, reduced slice) is visible to a peer that loads
// the flag.
func (v ctlView) store(off int, x uint64) { atomic.StoreUint64(v.word(off), x) }

func (v ctlView) desc(seq uint64) *descriptor {
	return (*descriptor)(unsafe.Add(v.base, offDesc+int(seq&1)*lineBytes))
}
