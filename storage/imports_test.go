package storage

import (
	"context"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// TestImportBoundary: storage depends on neither the HTTP layer nor the
// upstream client, directly or through another package, so that both can
// build on it.
func TestImportBoundary(t *testing.T) {
	t.Parallel()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skipf("go command not found: %v", err)
	}
	const module = "github.com/pullproxy/pullproxy/"
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, goTool, "list", "-deps", "-f", "{{.ImportPath}}", module+"storage").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	for dep := range strings.FieldsSeq(string(out)) {
		for _, banned := range []string{"proxy", "upstream"} {
			if dep == module+banned || strings.HasPrefix(dep, module+banned+"/") {
				t.Errorf("storage depends on %s: got it among its imports, want neither %sproxy nor %supstream", dep, module, module)
			}
		}
	}
}
