package storage

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/opencontainers/go-digest"
)

// ingestPiece is how much of a blob Ingest writes at once.
const ingestPiece = 1 << 20

// Ingest stores blob d of size bytes read from r, verified against both
// before it is committed (ErrSizeMismatch, ErrDigestMismatch otherwise, and
// nothing is kept). It reports whether the blob was added: false when the
// store held it already (r is then not read).
func (s *Store) Ingest(ctx context.Context, d digest.Digest, size int64, r io.Reader) (bool, error) {
	if _, err := s.StatBlob(ctx, d); err == nil {
		return false, nil
	}
	p, err := s.NewPartial(ctx, d, size)
	if err != nil {
		return false, err
	}
	buf := make([]byte, ingestPiece)
	var off int64
	for {
		if err := ctx.Err(); err != nil {
			p.Abandon(err)
			return false, err
		}
		n, rerr := io.ReadFull(r, buf)
		if n > 0 {
			if off+int64(n) > size {
				err := fmt.Errorf("ingesting %s: more than the %d bytes declared: %w", d, size, ErrSizeMismatch)
				p.Fail(err)
				return false, err
			}
			if _, err := p.WriteAt(buf[:n], off); err != nil {
				p.Fail(err)
				return false, err
			}
			off += int64(n)
		}
		if errors.Is(rerr, io.EOF) || errors.Is(rerr, io.ErrUnexpectedEOF) {
			break
		}
		if rerr != nil {
			err := fmt.Errorf("ingesting %s: reading: %w", d, rerr)
			p.Fail(err)
			return false, err
		}
	}
	if err := p.Commit(ctx); err != nil {
		return false, err // Commit fails the partial itself
	}
	return true, nil
}
