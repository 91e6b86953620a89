package content

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestImportBoundary: content depends on no other package of the module,
// so that upstream can write into a download without depending on storage.
func TestImportBoundary(t *testing.T) {
	t.Parallel()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	const module = "github.com/pullproxy/pullproxy/"
	const self = module + "storage/content"
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, goTool, "list", "-deps", "-f", "{{.ImportPath}}", self).Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for dep := range strings.FieldsSeq(string(out)) {
		if dep != self && strings.HasPrefix(dep, module) {
			t.Errorf("content depends on %s: got it among its imports, want no package of %s", dep, strings.TrimSuffix(module, "/"))
		}
	}
}
