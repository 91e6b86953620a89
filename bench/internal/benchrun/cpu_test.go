package benchrun

import (
	"os"
	"testing"
)

// TestReadMachineCPU: the machine's busy time reads as a positive count
// that never goes back.
func TestReadMachineCPU(t *testing.T) {
	first, err := ReadMachineCPU()
	if err != nil {
		t.Fatal(err)
	}
	second, err := ReadMachineCPU()
	if err != nil {
		t.Fatal(err)
	}
	if first <= 0 || second < first {
		t.Errorf("machine CPU: got %v then %v, want a positive count that does not decrease", first, second)
	}
}

func TestProcField(t *testing.T) {
	status := []byte("Name:\tpullproxy\nvoluntary_ctxt_switches:\t1234\nnonvoluntary_ctxt_switches:\t56\n")
	tests := []struct {
		key  string
		want int64
		ok   bool
	}{
		{"voluntary_ctxt_switches:", 1234, true},
		{"nonvoluntary_ctxt_switches:", 56, true},
		{"syscr:", 0, false},
	}
	for _, tt := range tests {
		got, err := procField(status, tt.key)
		if (err == nil) != tt.ok || got != tt.want {
			t.Errorf("procField(%q): got %d, %v; want %d (ok %v)", tt.key, got, err, tt.want, tt.ok)
		}
	}
}

func TestReadActivity(t *testing.T) {
	a, err := ReadActivity(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if a.ReadCalls <= 0 || a.Switches <= 0 {
		t.Errorf("this process: %+v, want some reads and switches", a)
	}
}
