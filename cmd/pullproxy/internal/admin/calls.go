package admin

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strings"
	"sync/atomic"
	"syscall"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
)

// Seed asks a running server's admin endpoint to seed, and
// copies what it reports to out.
func Seed(ctx context.Context, server Target, req mirror.SeedRequest, out io.Writer) error {
	body, _ := json.Marshal(req)
	resp, err := Call(ctx, server, http.MethodPost, "/seed", "application/json", bytes.NewReader(body))
	if err != nil {
		return fmt.Errorf("seed: %w", err)
	}
	defer resp.Body.Close()
	ok := false
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		line := sc.Text()
		if line == "done" {
			ok = true
			continue
		}
		fmt.Fprintln(out, line)
	}
	if !ok {
		return errors.New("seed: some images failed, or the server stopped before the end")
	}
	return nil
}

// Import sends each archive to a running server's admin
// endpoint, and copies what it reports to out.
func Import(ctx context.Context, server Target, files []string, retag bool, out io.Writer) error {
	failed := 0
	for _, file := range files {
		f, err := os.Open(file)
		if err != nil {
			return fmt.Errorf("import: %w", err)
		}
		q := url.Values{"name": {file}}
		if retag {
			q.Set("retag", "1")
		}
		resp, err := Call(ctx, server, http.MethodPost, "/import?"+q.Encode(), "application/x-tar", f)
		f.Close()
		if connectionCut(err) {
			fmt.Fprintf(out, "error %s: %s\n", file, cutMessage(err))
			failed++
			continue
		}
		if errors.Is(err, ErrRefused) {
			fmt.Fprintln(out, err)
			failed++
			continue
		}
		if err != nil {
			return fmt.Errorf("import: %w", err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		text := strings.TrimSpace(string(body))
		if err != nil && text == "" {
			fmt.Fprintf(out, "error %s: %s\n", file, cutMessage(err))
			failed++
			continue
		}
		if err != nil || !strings.HasSuffix(text, "done") {
			fmt.Fprintln(out, text)
			failed++
			continue
		}
		fmt.Fprintln(out, strings.TrimSuffix(text, "done"))
	}
	if failed > 0 {
		return fmt.Errorf("import: %d of %d archives refused", failed, len(files))
	}
	return nil
}

// connectionCut tells whether err is the admin endpoint's connection
// closed before its answer: the server stopped, or the connection broke.
func connectionCut(err error) bool {
	return errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, syscall.ECONNRESET)
}

// cutMessage tells the operator what an import cut off means: a server
// takes back what an unfinished import added, at the latest when it
// starts next.
func cutMessage(err error) string {
	return fmt.Sprintf("import cancelled: the admin endpoint closed the connection before the import ended (%v); "+
		"nothing was kept (the server takes back what an unfinished import added, at the latest when it starts next)", err)
}

// Export asks a running server's admin endpoint for the
// archive, and writes it to out.
func Export(ctx context.Context, server Target, refs []string, out string, stdout io.Writer) error {
	q := url.Values{"ref": refs}
	resp, err := Call(ctx, server, http.MethodGet, "/export?"+q.Encode(), "", nil)
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	defer resp.Body.Close()
	var got atomic.Int64
	report := progress.Start(stdout, progress.IsTerminal(stdout), "exporting", func() (int64, int64, string) { return got.Load(), 0, "" })
	err = fsutil.WriteFileFunc(out, func(w io.Writer) error {
		_, err := io.Copy(w, progress.CountingReader{R: resp.Body, N: &got})
		return err
	})
	report.End()
	if err != nil {
		return fmt.Errorf("export: %w", err)
	}
	// The server says what it exported in a trailer-free way: the
	// archive's index names each image.
	fmt.Fprintf(stdout, "wrote %s (%s)\n", out, progress.Bytes(got.Load()))
	return nil
}

// Forget asks the admin endpoint t to forget that d was served corrupt,
// and returns what it ended.
func Forget(ctx context.Context, server Target, d string) (ForgetAnswer, error) {
	body, err := json.Marshal(forgetRequest{Digest: d})
	if err != nil {
		return ForgetAnswer{}, err
	}
	resp, err := Call(ctx, server, http.MethodPost, "/forget", "application/json", bytes.NewReader(body))
	if err != nil {
		return ForgetAnswer{}, err
	}
	defer resp.Body.Close()
	var ans ForgetAnswer
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&ans); err != nil {
		return ForgetAnswer{}, fmt.Errorf("the admin endpoint's answer: %w", err)
	}
	return ans, nil
}
