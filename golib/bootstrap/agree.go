package bootstrap

import (
	"bytes"
	"encoding/binary"
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// Agree is a collective step that turns one rank's failure into every
// rank's: each rank passes its own outcome (nil for success) and gets back
// its own error, or, if it succeeded, an error naming the first rank that
// failed (with that rank's status code), or nil when every rank succeeded.
// Setup code calls it before a collective that a failed rank would skip, so
// its peers do not wait for it until a timeout.
func Agree(bs Bootstrap, local error) error {
	var msg []byte
	if local != nil {
		msg = binary.LittleEndian.AppendUint32(nil, uint32(status.CodeOf(local)))
		msg = append(msg, local.Error()...)
	}
	all, err := bs.AllGather(msg)
	if local != nil {
		return local
	}
	if err != nil {
		return fmt.Errorf("exchange outcome: %w", err)
	}
	for r, m := range all {
		if len(m) >= 4 {
			code := status.Code(binary.LittleEndian.Uint32(m))
			why := bytes.TrimSpace(m[4:])
			if len(why) == 0 { // an error with no text would read as a cut-off message
				return status.Errorf(code, "rank %d failed (%s) and gave no reason", r, code)
			}
			return status.Errorf(code, "rank %d failed: %s", r, why)
		}
	}
	return nil
}
