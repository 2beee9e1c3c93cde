package bootstrap

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"strings"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Wire format of the TCP bootstrap. Every message is a 32-byte header
// followed by the payload, all integers little-endian:
//
//	offset size field
//	0      4    magic "P2PC"
//	4      2    version (WireVersion)
//	6      2    type (MsgType)
//	8      8    job token
//	16     4    sender rank
//	20     4    sender's world size
//	24     4    sequence number of the collective (0 during rendezvous)
//	28     4    payload length in bytes
//	32     n    payload
const (
	// WireVersion is bumped whenever the header or a payload layout changes.
	WireVersion uint16 = 1
	// HeaderSize is the size of the fixed message header in bytes.
	HeaderSize = 32
	// MaxPayload bounds one message's payload. Bootstrap data is handles and
	// addresses, so this is far above what a job needs and far below what
	// would hurt to allocate for a corrupt length.
	MaxPayload = 64 << 20
)

var wireMagic = [4]byte{'P', '2', 'P', 'C'}

// MsgType says what a message is for.
type MsgType uint16

const (
	MsgHello        MsgType = 1 // peer -> rank 0: who I am
	MsgHelloAck     MsgType = 2 // rank 0 -> peer: everyone arrived
	MsgError        MsgType = 3 // either way: I failed, payload says why
	MsgGather       MsgType = 4 // peer -> rank 0: my all-gather contribution
	MsgGatherResult MsgType = 5 // rank 0 -> peer: every rank's contribution
	numMsgTypes             = 6
)

var msgTypeNames = [numMsgTypes]string{"", "hello", "hello-ack", "error", "gather", "gather-result"}

// Valid reports whether t is a known message type.
func (t MsgType) Valid() bool { return t >= MsgHello && t < numMsgTypes }

func (t MsgType) String() string {
	if !t.Valid() {
		return fmt.Sprintf("msgtype(%d)", uint16(t))
	}
	return msgTypeNames[t]
}

// Message is one decoded bootstrap message. The version and magic are
// implied: Encode writes the current ones and Decode rejects any other.
type Message struct {
	Type    MsgType
	Token   uint64
	Rank    uint32
	Size    uint32
	Seq     uint32
	Payload []byte
}

// Encode writes m to w in one Write call, so a message is never interleaved
// with another writer's bytes at the syscall level.
func Encode(w io.Writer, m Message) error {
	if !m.Type.Valid() {
		return status.Errorf(status.InvalidArgument, "encode: unknown message type %d", uint16(m.Type))
	}
	if len(m.Payload) > MaxPayload {
		return status.Errorf(status.Capacity, "encode: %s payload of %d bytes exceeds the limit of %d",
			m.Type, len(m.Payload), MaxPayload)
	}
	buf := make([]byte, HeaderSize+len(m.Payload))
	copy(buf[0:4], wireMagic[:])
	binary.LittleEndian.PutUint16(buf[4:], WireVersion)
	binary.LittleEndian.PutUint16(buf[6:], uint16(m.Type))
	binary.LittleEndian.PutUint64(buf[8:], m.Token)
	binary.LittleEndian.PutUint32(buf[16:], m.Rank)
	binary.LittleEndian.PutUint32(buf[20:], m.Size)
	binary.LittleEndian.PutUint32(buf[24:], m.Seq)
	binary.LittleEndian.PutUint32(buf[28:], uint32(len(m.Payload)))
	copy(buf[HeaderSize:], m.Payload)
	_, err := w.Write(buf)
	return err
}

// errBadMessage marks a message that arrived whole but is not valid, as
// opposed to a read that failed; callers use it to blame the sender.
var errBadMessage = errors.New("bad bootstrap message")

// Decode reads one message from r. It checks the magic, version, type and
// payload length (at most maxPayload) before allocating the payload. A
// stream that ends before the first byte returns io.EOF; one that ends
// inside a message returns io.ErrUnexpectedEOF; read errors (deadlines) are
// returned as is. An invalid header returns a status.Bootstrap error.
func Decode(r io.Reader, maxPayload int) (Message, error) {
	var hdr [HeaderSize]byte
	// The magic first, so a stray client is turned away without waiting
	// for a whole header it may never send.
	if _, err := io.ReadFull(r, hdr[:4]); err != nil {
		return Message{}, err
	}
	if [4]byte(hdr[0:4]) != wireMagic {
		return Message{}, badMessage("magic %q, want %q (not a p2pcomm peer?)", hdr[0:4], wireMagic[:])
	}
	if _, err := io.ReadFull(r, hdr[4:]); err != nil {
		return Message{}, unexpectedEOF(err)
	}
	if v := binary.LittleEndian.Uint16(hdr[4:]); v != WireVersion {
		return Message{}, badMessage("wire version %d, want %d (mixed p2pcomm versions?)", v, WireVersion)
	}
	m := Message{
		Type:  MsgType(binary.LittleEndian.Uint16(hdr[6:])),
		Token: binary.LittleEndian.Uint64(hdr[8:]),
		Rank:  binary.LittleEndian.Uint32(hdr[16:]),
		Size:  binary.LittleEndian.Uint32(hdr[20:]),
		Seq:   binary.LittleEndian.Uint32(hdr[24:]),
	}
	if !m.Type.Valid() {
		return Message{}, badMessage("unknown message type %d", uint16(m.Type))
	}
	n := binary.LittleEndian.Uint32(hdr[28:])
	if maxPayload < 0 {
		maxPayload = 0
	}
	if uint64(n) > uint64(maxPayload) {
		return Message{}, badMessage("%s payload of %d bytes exceeds the limit of %d", m.Type, n, maxPayload)
	}
	if n > 0 {
		m.Payload = make([]byte, n)
		if _, err := io.ReadFull(r, m.Payload); err != nil {
			return Message{}, unexpectedEOF(err)
		}
	}
	return m, nil
}

// unexpectedEOF reports a stream that ended inside a message.
func unexpectedEOF(err error) error {
	if err == io.EOF {
		return io.ErrUnexpectedEOF
	}
	return err
}

func badMessage(format string, args ...any) error {
	return fmt.Errorf("%w: %w", status.Errorf(status.Bootstrap, format, args...), errBadMessage)
}

// encodeList packs byte slices as a count followed by length-prefixed items.
func encodeList(items [][]byte) []byte {
	n := 4
	for _, it := range items {
		n += 4 + len(it)
	}
	buf := make([]byte, 0, n)
	buf = binary.LittleEndian.AppendUint32(buf, uint32(len(items)))
	for _, it := range items {
		buf = binary.LittleEndian.AppendUint32(buf, uint32(len(it)))
		buf = append(buf, it...)
	}
	return buf
}

// decodeList is the inverse of encodeList; it insists on exactly want items
// and no trailing bytes. Items are copies, not views into buf.
func decodeList(buf []byte, want int) ([][]byte, error) {
	if len(buf) < 4 {
		return nil, badMessage("list of %d bytes has no count", len(buf))
	}
	if n := binary.LittleEndian.Uint32(buf); uint64(n) != uint64(want) {
		return nil, badMessage("list has %d items, want %d", n, want)
	}
	buf = buf[4:]
	if uint64(want)*4 > uint64(len(buf)) {
		return nil, badMessage("list of %d items cannot fit in %d bytes", want, len(buf))
	}
	items := make([][]byte, want)
	for i := range items {
		if len(buf) < 4 {
			return nil, badMessage("list item %d: truncated length", i)
		}
		n := binary.LittleEndian.Uint32(buf)
		buf = buf[4:]
		if uint64(n) > uint64(len(buf)) {
			return nil, badMessage("list item %d: length %d exceeds the %d bytes left", i, n, len(buf))
		}
		items[i] = append([]byte{}, buf[:n]...)
		buf = buf[n:]
	}
	if len(buf) != 0 {
		return nil, badMessage("list has %d trailing bytes", len(buf))
	}
	return items, nil
}

// encodeError packs a status code and message so the receiver can return an
// error with the same code as the sender.
func encodeError(err error) []byte {
	msg := err.Error()
	buf := binary.LittleEndian.AppendUint32(nil, uint32(status.CodeOf(err)))
	return append(buf, msg...)
}

// decodeError is the inverse of encodeError.
func decodeError(payload []byte) (status.Code, string) {
	if len(payload) < 4 {
		return status.Bootstrap, "(no reason given)"
	}
	code := status.Code(binary.LittleEndian.Uint32(payload))
	if code == status.OK {
		code = status.Bootstrap
	}
	// The sender's message starts with the same package prefix as ours.
	return code, strings.TrimPrefix(string(payload[4:]), "bootstrap: ")
}
