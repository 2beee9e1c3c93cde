package proxy

import (
	"fmt"
	"math/bits"
)

// Trigger types, as the kTrigger* bits of native/kernels/channel.cuh.
const (
	TriggerPut    = 1 // copy Size bytes from a local memory to a peer's
	TriggerSignal = 2 // add one to the channel's peer semaphore after the channel's earlier puts
	TriggerFlush  = 4 // report the trigger done only once the channel's peer is flushed
)

// Field widths and limits of a trigger (channel.cuh's kTrigger* constants).
const (
	sizeBits    = 31
	offsetBits  = 32
	memoryBits  = 8
	typeBits    = 3
	channelBits = 10
	lapBit      = 63
	fstLapBit   = 31 // the lap bit's copy in the first word

	MaxMemories = 1 << memoryBits  // memory ids a trigger can name, per direction
	MaxChannels = 1 << channelBits // channels of one Service
	MaxOffset   = 1<<offsetBits - 1
	MaxSize     = 1<<sizeBits - 1
)

// Inline puts (channel.cuh's kInlineMemory, kInlineBytes): a put whose
// SrcMemory is InlineMemory carries its bytes in the FIFO, in the payload
// slot of its position (the ring's slots are followed by as many payloads
// of InlineBytes). Registered memories take the ids below InlineMemory.
const (
	InlineMemory = MaxMemories - 1
	InlineBytes  = 64
)

// Error codes and phases the device records in the communicator's
// ErrorWord for channel waits (channel.cuh).
const (
	ErrCodeProxy     = 5 // kErrProxy: the proxy failed a trigger of the FIFO
	PhaseChannelWait = 7 // kPhaseChannelWait
	PhaseFifoPush    = 8 // kPhaseFifoPush
	PhaseFifoFlush   = 9 // kPhaseFifoFlush
)

// Sizes of the FIFO's words (FifoDeviceWords, FifoHostWords).
const (
	deviceWordsSize = 256
	hostWordsSize   = 256
)

// Trigger is one FIFO entry as the device writes it (channel.cuh's Trigger).
type Trigger struct {
	Fst, Snd uint64
}

// Op is a decoded trigger: what the proxy runs.
type Op struct {
	Type      uint32 // Trigger* bits
	Channel   uint32 // id from Service.AddChannel
	DstMemory uint32 // id from Service.AddRemote
	SrcMemory uint32 // id from Service.AddLocal
	DstOffset uint64
	SrcOffset uint64
	Size      uint64
}

// Encode packs op into a trigger with the lap bit clear. It fails for
// fields wider than the layout holds, which the device would cut silently.
func (op Op) Encode() (Trigger, error) {
	if op.Type == 0 || op.Type >= 1<<typeBits || op.Channel >= MaxChannels || op.DstMemory >= MaxMemories ||
		op.SrcMemory >= MaxMemories || op.DstOffset > MaxOffset || op.SrcOffset > MaxOffset || op.Size > MaxSize {
		return Trigger{}, fmt.Errorf("trigger %+v does not fit the 16-byte layout", op)
	}
	return Trigger{
		Fst: op.Size | op.SrcOffset<<32,
		Snd: op.DstOffset | uint64(op.SrcMemory)<<32 | uint64(op.DstMemory)<<40 | uint64(op.Type)<<48 |
			uint64(op.Channel)<<51,
	}, nil
}

func field(v uint64, shift, bits int) uint64 { return v >> shift & (1<<bits - 1) }

// Decode unpacks a trigger; the lap bits are ignored.
func Decode(t Trigger) Op {
	return Op{
		Size:      field(t.Fst, 0, sizeBits),
		SrcOffset: field(t.Fst, 32, offsetBits),
		DstOffset: field(t.Snd, 0, offsetBits),
		SrcMemory: uint32(field(t.Snd, 32, memoryBits)),
		DstMemory: uint32(field(t.Snd, 40, memoryBits)),
		Type:      uint32(field(t.Snd, 48, typeBits)),
		Channel:   uint32(field(t.Snd, 51, channelBits)),
	}
}

// lap is the lap bit an entry at position pos carries: set on even laps, so
// zeroed memory never looks fresh. slots is a power of two: a shift, not a
// division, on the proxy's polling path.
func lap(pos, slots uint64) uint64 { return pos>>bits.TrailingZeros64(slots)&1 ^ 1 }

// deviceWords mirrors FifoDeviceWords (device memory: pushers' atomics).
type deviceWords struct {
	Head      uint64
	_         [15]uint64
	TailCache uint64
	_         [15]uint64
}

// hostWords mirrors FifoHostWords (pinned host memory the proxy writes).
type hostWords struct {
	Tail  uint64
	_     [15]uint64
	Done  uint64
	Error uint32
	_     [29]uint32
}

// FifoHandle mirrors the device's FifoHandle: device addresses of one FIFO.
type FifoHandle struct {
	Ring  uintptr // Trigger[Slots], mapped host memory
	Dev   uintptr // FifoDeviceWords
	Host  uintptr // FifoHostWords, mapped host memory
	Slots uint32
	ID    uint32
}

// PortChannel mirrors the device's PortChannel, the by-value kernel
// argument; the Service and the memories it names must outlive the kernel.
type PortChannel struct {
	FIFO       FifoHandle
	Sem        uintptr // inbound semaphore (device memory) the peer's proxy adds to
	Expected   uintptr // device memory: signals consumed
	Err        uintptr // the communicator's ErrorWord, may be 0
	TimeoutNs  uint64
	Channel    uint32
	DstMemory  uint32
	SrcMemory  uint32
	Rank, Peer int32
	InlineMax  uint32  // puts of at most this many bytes travel in the FIFO (0: none)
	SrcBase    uintptr // device address of SrcMemory, which inline puts read
}

// MemoryChannel mirrors the device's MemoryChannel.
type MemoryChannel struct {
	Remote, Local, Packets uintptr
	RemoteSem, Sem         uintptr
	Expected, Err          uintptr
	TimeoutNs              uint64
	Rank, Peer             int32
}
