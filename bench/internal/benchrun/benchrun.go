// Package benchrun holds what pullproxy's benchmarks share: what a run was
// measured on (the commit, the tools' versions), medians and worst runs,
// writing the results as JSON, and building and running pullproxy itself.
package benchrun

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Provenance says what the figures were measured on.
type Provenance struct {
	Commit    string            `json:"commit"`            // git rev-parse HEAD when the run started
	Dirty     bool              `json:"dirty"`             // the work tree had changes (git status --porcelain)
	Changes   []string          `json:"changes,omitempty"` // which: git status --porcelain's lines
	GoVersion string            `json:"go_version"`        // the go that built pullproxy
	Tools     map[string]string `json:"tools,omitempty"`
	Date      string            `json:"date"` // when the run started, UTC
	CPUs      int               `json:"cpus"`
}

// ReadProvenance reads the commit and the versions of go and of the given
// tools, each a command line that prints its version (its first line is
// kept, from standard output or error: nginx -v writes to the latter).
func ReadProvenance(ctx context.Context, tools ...[]string) (Provenance, error) {
	p := Provenance{Date: time.Now().UTC().Format(time.RFC3339), CPUs: runtime.NumCPU()}
	var err error
	if p.Commit, err = Output(ctx, "git", "rev-parse", "HEAD"); err != nil {
		return p, err
	}
	// --no-optional-locks: reading the status must not rewrite git's index.
	status, err := Output(ctx, "git", "--no-optional-locks", "status", "--porcelain")
	if err != nil {
		return p, err
	}
	p.Dirty = status != ""
	if p.Dirty {
		p.Changes = strings.Split(status, "\n")
	}
	if p.GoVersion, err = Output(ctx, "go", "env", "GOVERSION"); err != nil {
		return p, err
	}
	for _, t := range tools {
		out, _ := exec.CommandContext(ctx, t[0], t[1:]...).CombinedOutput() // wrk -v exits 1
		first, _, _ := strings.Cut(strings.TrimSpace(string(out)), "\n")
		if p.Tools == nil {
			p.Tools = map[string]string{}
		}
		p.Tools[t[0]] = first
	}
	return p, nil
}

// String is the provenance as one line for a report's head.
func (p Provenance) String() string {
	tree := ""
	if p.Dirty {
		tree = " with uncommitted changes (" + strings.Join(p.Changes, "; ") + ")"
	}
	tools := []string{p.GoVersion}
	for _, name := range slices.Sorted(maps.Keys(p.Tools)) {
		tools = append(tools, p.Tools[name])
	}
	return fmt.Sprintf("Commit %s%s; %s; %s; %d CPUs.", p.Commit, tree, p.Date, strings.Join(tools, "; "), p.CPUs)
}

// Output runs a command and returns its standard output, trimmed.
func Output(ctx context.Context, name string, args ...string) (string, error) {
	out, err := exec.CommandContext(ctx, name, args...).Output()
	if err != nil {
		var stderr []byte
		if ee := (*exec.ExitError)(nil); errors.As(err, &ee) {
			stderr = bytes.TrimSpace(ee.Stderr)
		}
		return "", fmt.Errorf("%s %s: %w %s", name, strings.Join(args, " "), err, stderr)
	}
	return strings.TrimSpace(string(out)), nil
}

// WriteJSON writes v, indented, to path.
func WriteJSON(path string, v any) error {
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false) // errors quote "->"
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("encoding the results: %w", err)
	}
	if err := os.WriteFile(path, buf.Bytes(), 0o644); err != nil {
		return fmt.Errorf("writing the results: %w", err)
	}
	return nil
}

// Summary is one figure over the runs of a measurement.
type Summary struct {
	Runs   []float64 `json:"runs"`
	Median float64   `json:"median"`
	Worst  float64   `json:"worst"`
}

// Summarise summarises runs; worst is the largest (larger is worse) or,
// with lowerIsWorse, the smallest.
func Summarise(runs []float64, lowerIsWorse bool) Summary {
	s := Summary{Runs: runs, Median: Median(runs)}
	if len(runs) > 0 {
		s.Worst = slices.Max(runs)
		if lowerIsWorse {
			s.Worst = slices.Min(runs)
		}
	}
	return s
}

// Median is the median of xs, 0 when there are none.
func Median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// Ratio is one measurement over another, round by round: where two
// servers take turns in each round, the machine's drift over a run (tens of
// per cent on a shared virtual machine) moves both figures of a round
// together, so the ratio within rounds varies less than the ratio of the
// medians, and says how often the one came out ahead.
type Ratio struct {
	Of     string    `json:"of"`     // "a/b": what was divided by what
	Rounds []float64 `json:"rounds"` // a/b in each round both measured
	Median float64   `json:"median"`
	Low    float64   `json:"low"`
	High   float64   `json:"high"`
}

// RoundRatios returns a[i]/b[i] for the rounds both have (a run that
// failed ends a series early), skipping rounds where b is 0.
func RoundRatios(of string, a, b []float64) Ratio {
	r := Ratio{Of: of}
	for i := range min(len(a), len(b)) {
		if b[i] != 0 {
			r.Rounds = append(r.Rounds, a[i]/b[i])
		}
	}
	if len(r.Rounds) > 0 {
		r.Median, r.Low, r.High = Median(r.Rounds), slices.Min(r.Rounds), slices.Max(r.Rounds)
	}
	return r
}

// String says the ratio as "0.98x (0.91-1.04 over 7 rounds)".
func (r Ratio) String() string {
	if len(r.Rounds) == 0 {
		return "no round measured both"
	}
	rounds := "rounds"
	if len(r.Rounds) == 1 {
		rounds = "round"
	}
	return fmt.Sprintf("%.2fx (%.2f-%.2f over %d %s)", r.Median, r.Low, r.High, len(r.Rounds), rounds)
}

// BuildPullproxy builds ./cmd/pullproxy (run from the repository's root)
// into dir and returns the binary's path.
func BuildPullproxy(ctx context.Context, dir string) (string, error) {
	bin := filepath.Join(dir, "pullproxy")
	return bin, Build(ctx, bin, "./cmd/pullproxy")
}

// Build builds the package pkg (a path relative to the repository's root,
// where the benchmark runs) into the binary bin.
func Build(ctx context.Context, bin, pkg string) error {
	if out, err := exec.CommandContext(ctx, "go", "build", "-o", bin, pkg).CombinedOutput(); err != nil {
		return fmt.Errorf("building %s (run from the repository root): %w\n%s", pkg, err, out)
	}
	return nil
}

// Process is a server started by a benchmark: pullproxy, or another that
// logs the address it serves on.
type Process struct {
	Addr   string // host:port it serves on
	cmd    *exec.Cmd
	exited chan struct{}
	tail   chan []string // its last log lines
}

// PullproxyAddr finds the address in pullproxy's start-up line.
var PullproxyAddr = regexp.MustCompile(`msg="pullproxy serving".* addr=(\S+)`)

// Start starts cmd and waits until a line of its standard error matches
// addr (whose first group is the address it serves on). Every line also goes
// to log when not nil; lines with level=ERROR go to os.Stderr.
func Start(ctx context.Context, cmd *exec.Cmd, addr *regexp.Regexp, log io.Writer) (*Process, error) {
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, fmt.Errorf("starting %s: %w", cmd.Path, err)
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("starting %s: %w", cmd.Path, err)
	}
	p := &Process{cmd: cmd, exited: make(chan struct{}), tail: make(chan []string, 1)}
	p.tail <- nil
	addrc := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(stderr)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			line := sc.Text()
			if log != nil {
				fmt.Fprintln(log, line)
			}
			if m := addr.FindStringSubmatch(line); m != nil {
				select {
				case addrc <- m[1]:
				default:
				}
			}
			if strings.Contains(line, "level=ERROR") {
				fmt.Fprintln(os.Stderr, filepath.Base(cmd.Path)+":", line)
			}
			t := <-p.tail
			p.tail <- append(t[max(0, len(t)-19):], line)
		}
		io.Copy(io.Discard, stderr)
		cmd.Wait()
		close(p.exited)
	}()
	select {
	case p.Addr = <-addrc:
		return p, nil
	case <-p.exited:
		return nil, fmt.Errorf("%s exited before serving: %s", cmd.Path, strings.Join(p.Tail(), "\n"))
	case <-time.After(30 * time.Second):
	case <-ctx.Done():
	}
	p.Kill()
	return nil, fmt.Errorf("%s did not start within 30 s: %s", cmd.Path, strings.Join(p.Tail(), "\n"))
}

// Tail returns the process's last log lines.
func (p *Process) Tail() []string {
	t := <-p.tail
	p.tail <- t
	return t
}

// Pid is the process's id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Stop interrupts the process and waits for it, killing it after 30 s.
func (p *Process) Stop() {
	p.cmd.Process.Signal(os.Interrupt)
	select {
	case <-p.exited:
	case <-time.After(30 * time.Second):
		p.Kill()
	}
}

// Kill kills the process and waits for it.
func (p *Process) Kill() {
	p.cmd.Process.Kill()
	<-p.exited
}

// PeakRSSMiB returns the process's peak resident set size (VmHWM) in MiB,
// or 0 once it has exited.
func (p *Process) PeakRSSMiB() float64 {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(p.Pid()), "status"))
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			kb, _ := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 64)
			return kb / 1024
		}
	}
	return 0
}
