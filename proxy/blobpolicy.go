package proxy

import (
	"context"
	"errors"

	"github.com/opencontainers/go-digest"

	"github.com/pullproxy/pullproxy/storage"
)

// Two servers answer a GET or HEAD of a blob: net/http's handler
// (serveBlob) and the blob loop (fastPath.answer), which sends stored
// blobs on the connections it takes over and hands everything else back
// to the handler. Both ask storedBlobAllowed what to do, so that who may
// have which blob is decided in one place; they differ only in how they
// send it.

// blobVerdict is what storedBlobAllowed decides for a request of a blob.
type blobVerdict uint8

const (
	// blobRefused: the client is not to have the blob; the error says why,
	// as the client's answer.
	blobRefused blobVerdict = iota
	// blobServe: the store holds the blob and the client may have it
	// under the route's upstream and repository: send it from the store.
	blobServe
	// blobMissing: the store lacks the blob: answer a HEAD, or fetch it,
	// on the client's behalf (serveBlob does; the loop hands it back).
	blobMissing
	// blobUnconfirmed: the store holds the blob, but only the upstream
	// can say whether the route's repository does, and the caller asked
	// not to be kept waiting for it (the loop, which hands it back).
	blobUnconfirmed
)

// storedBlobAllowed decides a GET, or a HEAD when head is set, of blob
// rt.ref by the client at remote (host:port), given what opening the
// blob in the store returned: nil, storage.ErrNotFound, or why the store
// cannot say. In order:
//
//   - a client that rt's upstream's allow_clients leaves out is refused
//     (403 DENIED), whatever the store holds;
//   - a store that cannot say is the failure the client gets;
//   - a blob the store lacks is missing, to be fetched, except that a GET
//     through an offline upstream is refused (404, naming the fix): there
//     is nobody to fetch it from;
//   - a stored blob is served only under a repository that holds it (see
//     inRepository): one the store records as holding it, else one the
//     upstream confirms when confirm is set; else it is unconfirmed.
//
// A blob it lets be served is noted as accessed, for eviction, before it
// is sent. For a client allowed a blob stored and recorded under rt's
// repository, the common case, it does not allocate.
func (s *Server) storedBlobAllowed(ctx context.Context, rt route, remote string, head bool, stored error, confirm bool) (blobVerdict, error) {
	if !s.pullAllowed(rt, remote) {
		return blobRefused, clientDenied(rt, remote)
	}
	return s.blobAllowed(ctx, rt, head, stored, confirm)
}

// blobAllowed is storedBlobAllowed past allow_clients, which are for
// remote clients: what the mirror core's own calls (seed, export) are
// held to.
func (s *Server) blobAllowed(ctx context.Context, rt route, head bool, stored error, confirm bool) (blobVerdict, error) {
	d := digest.Digest(rt.ref) // validated by resolve
	switch {
	case errors.Is(stored, storage.ErrNotFound):
		if o, ok := rt.up.(offlineUpstream); ok && !head {
			return blobRefused, o.miss(rt.repo, "blob "+d.String())
		}
		return blobMissing, nil
	case stored != nil:
		return blobRefused, stored
	}
	known, err := s.members.IsMember(ctx, rt.up.Name(), rt.repo, d)
	if !known {
		if !confirm {
			return blobUnconfirmed, nil
		}
		if err := s.confirmInRepository(ctx, rt, kindBlob, d, err); err != nil {
			return blobRefused, err
		}
	}
	s.accesses.note(d)
	return blobServe, nil
}
