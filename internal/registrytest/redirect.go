package registrytest

import (
	"context"
	"net/http"
	"net/url"
	"path"

	storagedriver "github.com/distribution/distribution/v3/registry/storage/driver"
	storagemiddleware "github.com/distribution/distribution/v3/registry/storage/driver/middleware"
)

// blobStorePrefix is where, with WithBlobRedirects, the server serves its
// storage directory's files: blob GETs are redirected there.
const blobStorePrefix = "/blobstore"

// sameHostRedirect is the storage middleware behind WithBlobRedirects. Its
// name is registered with distribution's middleware factory in init, as
// distribution's own middlewares are (the factory's Register is not safe
// to call concurrently).
const sameHostRedirect = "registrytest-same-host-redirect"

func init() {
	if err := storagemiddleware.Register(sameHostRedirect, newSameHostRedirect); err != nil {
		panic(err)
	}
}

// sameHostRedirectDriver answers distribution's RedirectURL with the
// storage path under blobStorePrefix on the host the request was sent to,
// so that the redirect goes wherever the client reached the registry (a
// relay on a port chosen per benchmark run, say). distribution's own
// "redirect" middleware takes a fixed base URL.
type sameHostRedirectDriver struct {
	storagedriver.StorageDriver
}

func newSameHostRedirect(_ context.Context, sd storagedriver.StorageDriver, _ map[string]any) (storagedriver.StorageDriver, error) {
	return &sameHostRedirectDriver{StorageDriver: sd}, nil
}

func (d *sameHostRedirectDriver) RedirectURL(r *http.Request, storagePath string) (string, error) {
	scheme := "http"
	if r.TLS != nil {
		scheme = "https"
	}
	u := url.URL{Scheme: scheme, Host: r.Host, Path: path.Join(blobStorePrefix, storagePath)}
	return u.String(), nil
}

// withBlobStore serves the files of the storage directory dir under
// blobStorePrefix, and everything else with registry.
func withBlobStore(registry http.Handler, dir string) http.Handler {
	mux := http.NewServeMux()
	mux.Handle(blobStorePrefix+"/", http.StripPrefix(blobStorePrefix, http.FileServer(http.Dir(dir))))
	mux.Handle("/", registry)
	return mux
}
