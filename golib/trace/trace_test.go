package trace

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestWriteKeepsTheNewestInOrder: past Cap events the oldest go, and Write
// lists the rest oldest first, marks by their label, triggers by their fields.
func TestWriteKeepsTheNewestInOrder(t *testing.T) {
	to = filepath.Join(t.TempDir(), "tr")
	buf = make([]Event, Cap)
	count.Store(0)
	t.Cleanup(func() { buf, to = nil, "" })
	for i := range Cap + 10 {
		Add(Event{What: 'p', FIFO: 1, Pos: uint64(i), Type: 3, Channel: 2, Size: 4112})
	}
	Mark("launch")
	if err := Write(); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(fmt.Sprintf("%s.%d", to, os.Getpid()))
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
	if len(lines) != Cap {
		t.Fatalf("%d lines, want the newest %d events", len(lines), Cap)
	}
	if want := " p fifo=1 pos=11 type=3 channel=2 bytes=4112"; !strings.HasSuffix(lines[0], want) {
		t.Errorf("oldest kept: %q, want it to end %q", lines[0], want)
	}
	if !strings.HasSuffix(lines[Cap-1], " m launch") {
		t.Errorf("newest: %q, want the mark", lines[Cap-1])
	}
}

// TestOffRecordsNothing: with no prefix, Add and Mark keep nothing and Write
// writes no file.
func TestOffRecordsNothing(t *testing.T) {
	if On() {
		t.Skip("P2PCOMM_PROXY_TRACE is set in this test's environment")
	}
	before := count.Load()
	Add(Event{What: 'p'})
	Mark("x")
	if count.Load() != before || Write() != nil {
		t.Fatal("an event was kept with tracing off")
	}
}
