package benchrun

import "testing"

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
