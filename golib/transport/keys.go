package transport

import "encoding/binary"

// Ranks exchange the keys of several registered ranges in one message of the
// bootstrap: each key prefixed by its length (4 bytes, little endian).

// AppendKeys appends keys to out, each prefixed by its length.
func AppendKeys(out []byte, keys ...[]byte) []byte {
	for _, k := range keys {
		out = binary.LittleEndian.AppendUint32(out, uint32(len(k)))
		out = append(out, k...)
	}
	return out
}

// SplitKeys splits the first n keys AppendKeys wrote at the start of b; ok
// is false when b holds fewer.
func SplitKeys(b []byte, n int) (keys [][]byte, ok bool) {
	keys = make([][]byte, n)
	for i := range keys {
		if len(b) < 4 || uint64(len(b)-4) < uint64(binary.LittleEndian.Uint32(b)) {
			return nil, false
		}
		k := binary.LittleEndian.Uint32(b)
		keys[i], b = b[4:4+k], b[4+k:]
	}
	return keys, true
}
