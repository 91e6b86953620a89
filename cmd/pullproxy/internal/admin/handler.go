package admin

import (
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net/http"
	"os"
	"time"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/archive"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/fsutil"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/imageref"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/mirror"
	"github.com/pullproxy/pullproxy/cmd/pullproxy/internal/progress"
	"github.com/pullproxy/pullproxy/proxy/imagesync"
	"github.com/pullproxy/pullproxy/storage"
	"github.com/pullproxy/pullproxy/storage/bucket"
	"github.com/pullproxy/pullproxy/upstream"
)

// handler serves the admin endpoint over m, whose data dir is dataDir.
func handler(m *mirror.Mirror, dataDir string, log *slog.Logger) http.Handler {
	srv := m.Server
	mux := http.NewServeMux()
	mux.HandleFunc("GET /debug/upstreams", func(w http.ResponseWriter, r *http.Request) {
		st := []upstream.Status{}
		for _, u := range m.Upstreams {
			st = append(st, u.Status())
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(st)
	})
	mux.Handle("POST /forget", forgetHandler(m.Upstreams, log))
	mux.HandleFunc("GET /debug/bucket", serveBucketHealth(m))
	mux.HandleFunc("GET /debug/sync", func(w http.ResponseWriter, r *http.Request) {
		st := []imagesync.RuleStatus{}
		if m.Sync != nil {
			st = m.Sync.Status()
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(st)
	})
	mux.HandleFunc("GET /export", func(w http.ResponseWriter, r *http.Request) {
		var pins []imageref.Ref
		for _, ref := range r.URL.Query()["ref"] {
			p, err := imageref.Parse(ref)
			if err != nil {
				http.Error(w, "export: "+err.Error(), http.StatusBadRequest)
				return
			}
			pins = append(pins, p)
		}
		if len(pins) == 0 {
			http.Error(w, "export: want ?ref=registry/repository:tag (repeatable)", http.StatusBadRequest)
			return
		}
		log.Info("exporting through the admin endpoint", "refs", r.URL.Query()["ref"])
		// The archive is assembled first, so that a failure is an error
		// status rather than a tar cut short.
		tmp, err := os.CreateTemp(dataDir, ".export-*")
		if err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusInternalServerError)
			return
		}
		defer os.Remove(tmp.Name())
		defer tmp.Close()
		if err := archive.Export(r.Context(), srv, pins, dataDir, tmp, io.Discard, false); err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusBadGateway)
			return
		}
		fi, err := tmp.Stat()
		if err != nil {
			http.Error(w, "export: "+err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/x-tar")
		w.Header().Set("Content-Length", fmt.Sprint(fi.Size()))
		http.NewResponseController(w).SetWriteDeadline(time.Time{})
		io.Copy(w, io.NewSectionReader(tmp, 0, fi.Size()))
	})
	mux.HandleFunc("POST /import", func(w http.ResponseWriter, r *http.Request) {
		// The archive is kept beside the store first: reading an image
		// layout needs random access. Its size is known before a byte is
		// written, and bounded: never more than the store and the file
		// system can take.
		if r.ContentLength < 0 {
			http.Error(w, "import: send the archive with a Content-Length", http.StatusLengthRequired)
			return
		}
		if err := uploadFits(m.Store, dataDir, r.ContentLength); err != nil {
			http.Error(w, "import: "+err.Error(), http.StatusRequestEntityTooLarge)
			return
		}
		tmp, err := os.CreateTemp(dataDir, ".import-upload-*")
		if err != nil {
			http.Error(w, "import: "+err.Error(), http.StatusInternalServerError)
			return
		}
		defer os.Remove(tmp.Name())
		_, err = io.Copy(tmp, http.MaxBytesReader(w, r.Body, r.ContentLength))
		if cerr := tmp.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			http.Error(w, "import: receiving the archive: "+err.Error(), http.StatusBadRequest)
			return
		}
		name := r.URL.Query().Get("name")
		if name == "" {
			name = "the archive"
		}
		log.Info("importing through the admin endpoint", "archive", name)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		imp := archive.NewImporter(m, tmp.Name(), r.URL.Query().Get("retag") == "1")
		if err := imp.Run(r.Context()); err != nil {
			fmt.Fprintf(w, "error %s: %v\n", name, err)
			return
		}
		imp.Report(w, name)
		fmt.Fprintln(w, "done")
	})
	mux.HandleFunc("POST /seed", func(w http.ResponseWriter, r *http.Request) {
		var req mirror.SeedRequest
		if err := json.NewDecoder(io.LimitReader(r.Body, 1<<20)).Decode(&req); err != nil || len(req.Refs) == 0 {
			http.Error(w, "want JSON: {\"refs\": [...], \"platforms\": [...], \"referrers\": bool}", http.StatusBadRequest)
			return
		}
		log.Info("seeding through the admin endpoint", "refs", req.Refs, "platforms", req.Platforms, "referrers", req.Referrers)
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fw := flushWriter{w, http.NewResponseController(w)}
		// The client reads the progress as it comes; a seed takes longer
		// than any write timeout.
		fw.rc.SetWriteDeadline(time.Time{})
		if err := m.Seed(r.Context(), req, fw, false); err != nil {
			fmt.Fprintln(fw, err)
			return
		}
		fmt.Fprintln(fw, "done")
	})
	return mux
}

// uploadFits returns an error wrapping storage.ErrNoSpace when an upload
// of size bytes could not be kept in the data dir: above what the store
// may hold (max_size, storage.CheckFits), or above the file system's free
// space less the share kept free.
func uploadFits(store *storage.Store, dataDir string, size int64) error {
	if err := store.CheckFits(digest.Digest("the archive"), size); err != nil {
		return err
	}
	free, total, err := fsutil.Space(dataDir)
	if err != nil {
		return nil // nothing to tell by: the writes will say
	}
	if margin := min(total/20, 256<<20); size > free-margin {
		return fmt.Errorf("the archive is %s; the data dir's file system has %s free, of which %s is kept free: %w",
			progress.Bytes(size), progress.Bytes(free), progress.Bytes(margin), storage.ErrNoSpace)
	}
	return nil
}

// flushWriter sends each write to the client at once.
type flushWriter struct {
	w  io.Writer
	rc *http.ResponseController
}

func (f flushWriter) Write(p []byte) (int, error) {
	n, err := f.w.Write(p)
	f.rc.Flush()
	return n, err
}

// An endpoint that served a blob whose bytes failed verification is not
// asked for it again for a while (1 minute, doubling to 30). Once the
// operator has deleted the blob upstream and pushed it again, forget ends
// that wait, so that the next pull fetches it at once.

// forgetRequest is the body of POST /forget.
type forgetRequest struct {
	Digest string `json:"digest"`
}

// ForgetAnswer is POST /forget's answer: the waits it ended.
type ForgetAnswer struct {
	Digest  digest.Digest `json:"digest"`
	Cleared []Forgotten   `json:"cleared"`
}

// Forgotten is a wait forget ended: the upstream, and its endpoint's state.
type Forgotten struct {
	Upstream string `json:"upstream"`
	upstream.CorruptStatus
}

// forgetHandler serves POST /forget: it ends, on every upstream, the wait
// of each endpoint kept from the digest for serving it corrupt, and
// answers what it ended.
func forgetHandler(ups []*upstream.Registry, log *slog.Logger) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if mt, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type")); mt != "application/json" {
			http.Error(w, "forget: want Content-Type: application/json", http.StatusUnsupportedMediaType)
			return
		}
		var req forgetRequest
		if err := json.NewDecoder(io.LimitReader(r.Body, 4096)).Decode(&req); err != nil {
			http.Error(w, "forget: want JSON: {\"digest\": \"sha256:...\"}", http.StatusBadRequest)
			return
		}
		d, err := digest.Parse(req.Digest)
		if err != nil {
			http.Error(w, fmt.Sprintf("forget: %q is not a digest: %v", req.Digest, err), http.StatusBadRequest)
			return
		}
		ans := ForgetAnswer{Digest: d, Cleared: []Forgotten{}}
		for _, u := range ups {
			for _, c := range u.Forget(d) {
				ans.Cleared = append(ans.Cleared, Forgotten{Upstream: u.Name(), CorruptStatus: c})
			}
		}
		log.Info("forgetting a corrupt blob through the admin endpoint", "digest", d, "endpoints", len(ans.Cleared))
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(ans)
	})
}

// BucketStatus is what GET /debug/bucket answers: whether replicas share
// a bucket, and its health as this replica sees it.
type BucketStatus struct {
	Shared bool `json:"shared"`
	bucket.Health
}

// serveBucketHealth answers GET /debug/bucket for m.
func serveBucketHealth(m *mirror.Mirror) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		st := BucketStatus{}
		if m.Bucket != nil {
			st = BucketStatus{Shared: true, Health: m.Bucket.Health()}
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		enc.Encode(st)
	}
}
