package bootstrap

import (
	"bytes"
	"errors"
	"io"
	"reflect"
	"strings"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

func encoded(t testing.TB, m Message) []byte {
	t.Helper()
	var buf bytes.Buffer
	if err := Encode(&buf, m); err != nil {
		t.Fatalf("Encode(%+v): %v", m, err)
	}
	return buf.Bytes()
}

func TestWireRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		msg  Message
	}{
		{"hello", Message{Type: MsgHello, Token: 0xdeadbeefcafe, Rank: 3, Size: 8}},
		{"gather", Message{Type: MsgGather, Token: 1, Rank: 1, Size: 2, Seq: 42, Payload: []byte("handles")}},
		{"result", Message{Type: MsgGatherResult, Seq: 1<<32 - 1, Payload: encodeList([][]byte{{1}, {}, {2, 3}})}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			buf := encoded(t, tt.msg)
			if len(buf) != HeaderSize+len(tt.msg.Payload) {
				t.Errorf("encoded length = %d, want %d", len(buf), HeaderSize+len(tt.msg.Payload))
			}
			got, err := Decode(bytes.NewReader(buf), MaxPayload)
			if err != nil {
				t.Fatalf("Decode: %v", err)
			}
			if !reflect.DeepEqual(got, tt.msg) {
				t.Errorf("Decode(Encode(m)) = %+v, want %+v", got, tt.msg)
			}
		})
	}
}

func TestDecodeRejects(t *testing.T) {
	valid := encoded(t, Message{Type: MsgGather, Rank: 1, Size: 2, Payload: []byte("abcd")})
	patch := func(off int, b ...byte) []byte {
		out := append([]byte{}, valid...)
		copy(out[off:], b)
		return out
	}
	tests := []struct {
		name    string
		in      []byte
		max     int
		wantErr error  // errors.Is target, or nil to check the text
		want    string // substring of the error
	}{
		{"empty", nil, MaxPayload, io.EOF, ""},
		{"truncated magic", valid[:2], MaxPayload, io.ErrUnexpectedEOF, ""},
		{"magic only", valid[:4], MaxPayload, io.ErrUnexpectedEOF, ""},
		{"truncated header", valid[:HeaderSize-1], MaxPayload, io.ErrUnexpectedEOF, ""},
		{"truncated payload", valid[:len(valid)-1], MaxPayload, io.ErrUnexpectedEOF, ""},
		{"bad magic", patch(0, 'H', 'T', 'T', 'P'), MaxPayload, errBadMessage, "magic"},
		{"bad version", patch(4, 9, 0), MaxPayload, errBadMessage, "wire version 9"},
		{"type zero", patch(6, 0, 0), MaxPayload, errBadMessage, "unknown message type 0"},
		{"unknown type", patch(6, 99, 0), MaxPayload, errBadMessage, "unknown message type 99"},
		{"too long", valid, 3, errBadMessage, "exceeds the limit of 3"},
		{"huge length", patch(28, 0xff, 0xff, 0xff, 0xff), MaxPayload, errBadMessage, "4294967295 bytes"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Decode(bytes.NewReader(tt.in), tt.max)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("Decode = %v, want %v", err, tt.wantErr)
			}
			if !strings.Contains(errString(err), tt.want) {
				t.Errorf("Decode = %q, want it to contain %q", err, tt.want)
			}
			if tt.wantErr == errBadMessage && status.CodeOf(err) != status.Bootstrap {
				t.Errorf("CodeOf(%v) = %v, want %v", err, status.CodeOf(err), status.Bootstrap)
			}
		})
	}
}

func errString(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}

func TestEncodeRejects(t *testing.T) {
	tests := []struct {
		name string
		msg  Message
		want status.Code
	}{
		{"unknown type", Message{Type: 77}, status.InvalidArgument},
		{"too long", Message{Type: MsgGather, Payload: make([]byte, MaxPayload+1)}, status.Capacity},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			err := Encode(&buf, tt.msg)
			if got := status.CodeOf(err); got != tt.want {
				t.Errorf("Encode(%s) = %v (code %v), want code %v", tt.name, err, got, tt.want)
			}
			if buf.Len() != 0 {
				t.Errorf("Encode(%s) wrote %d bytes, want none", tt.name, buf.Len())
			}
		})
	}
}

func TestListRoundTripAndRejects(t *testing.T) {
	items := [][]byte{[]byte("rank0"), {}, bytes.Repeat([]byte{7}, 300)}
	buf := encodeList(items)
	got, err := decodeList(buf, len(items))
	if err != nil || !reflect.DeepEqual(got, items) {
		t.Fatalf("decodeList(encodeList(items)) = %q, %v; want %q", got, err, items)
	}
	bad := []struct {
		name string
		buf  []byte
		want int
	}{
		{"wrong count", buf, 2},
		{"no count", buf[:3], 3},
		{"truncated", buf[:len(buf)-1], 3},
		{"trailing", append(append([]byte{}, buf...), 0), 3},
	}
	for _, tt := range bad {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := decodeList(tt.buf, tt.want); !errors.Is(err, errBadMessage) {
				t.Errorf("decodeList(%s) = %v, want errBadMessage", tt.name, err)
			}
		})
	}
}

func TestErrorNoteKeepsCode(t *testing.T) {
	err := status.Errorf(status.Timeout, "bootstrap: rank 3 never arrived")
	code, msg := decodeError(encodeError(err))
	if code != status.Timeout || msg != "rank 3 never arrived" {
		t.Errorf("decodeError(encodeError(%v)) = %v, %q; want %v, %q", err, code, msg, status.Timeout, "rank 3 never arrived")
	}
}

// FuzzDecode checks that Decode never panics, never returns a payload over
// the limit, and that whatever it accepts encodes back to the same bytes.
func FuzzDecode(f *testing.F) {
	seeds := []Message{
		{Type: MsgHello, Token: 42, Rank: 1, Size: 4},
		{Type: MsgHelloAck, Token: 42, Size: 4},
		{Type: MsgError, Payload: encodeError(status.Errorf(status.Bootstrap, "why"))},
		{Type: MsgGather, Seq: 7, Payload: []byte("payload")},
		{Type: MsgGatherResult, Seq: 7, Payload: encodeList([][]byte{{1, 2}, nil})},
	}
	for _, m := range seeds {
		buf := encoded(f, m)
		f.Add(buf)
		f.Add(buf[:len(buf)/2])
		f.Add(buf[:HeaderSize-3])
	}
	f.Add([]byte("GET / HTTP/1.1\r\n\r\n"))
	const limit = 1 << 10
	f.Fuzz(func(t *testing.T, in []byte) {
		m, err := Decode(bytes.NewReader(in), limit)
		if err != nil {
			return
		}
		if len(m.Payload) > limit {
			t.Fatalf("Decode accepted a %d-byte payload over the limit %d", len(m.Payload), limit)
		}
		out := encoded(t, m)
		if !bytes.Equal(out, in[:len(out)]) {
			t.Fatalf("Encode(Decode(in)) = %x, want %x", out, in[:len(out)])
		}
		if m.Type == MsgGatherResult {
			decodeList(m.Payload, int(m.Size)) // must not panic
		}
	})
}
