package plan

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"strconv"
	"strings"
	"testing"
)

// TestPure guards what makes the planner a table: it imports no I/O,
// concurrency or randomness, starts no goroutine, and reads no clock (the
// time is passed in).
func TestPure(t *testing.T) {
	t.Parallel()
	allowed := map[string]bool{"math": true, "time": true}
	clocks := map[string]bool{"Now": true, "Since": true, "Until": true, "Sleep": true, "After": true,
		"AfterFunc": true, "NewTimer": true, "NewTicker": true, "Tick": true}
	fset := token.NewFileSet()
	entries, err := os.ReadDir(".")
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		name := e.Name()
		if !strings.HasSuffix(name, ".go") || strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, imp := range f.Imports {
			if path, _ := strconv.Unquote(imp.Path.Value); !allowed[path] {
				t.Errorf("%s imports %q: got an import beyond %v", name, path, allowed)
			}
		}
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.GoStmt:
				t.Errorf("%s: got a go statement at %v, want none", name, fset.Position(n.Pos()))
			case *ast.SelectorExpr:
				if x, ok := n.X.(*ast.Ident); ok && x.Name == "time" && clocks[n.Sel.Name] {
					t.Errorf("%s: got time.%s at %v, want the time passed in", name, n.Sel.Name, fset.Position(n.Pos()))
				}
			}
			return true
		})
	}
}
