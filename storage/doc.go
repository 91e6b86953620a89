// Package storage keeps what pullproxy has fetched: verified blobs (layers,
// configs and manifests alike, all content-addressed), blobs still being
// downloaded, and the metadata that ties tags and media types to digests.
//
// On-disk layout under the data directory:
//
//	<data-dir>/
//	├── blobs/
//	│   └── sha256/
//	│       └── ab/
//	│           └── ab12…ef          verified content, named by its hex digest
//	├── partial/
//	│   ├── sha256-ab12…ef           a blob being downloaded, written at its offsets
//	│   ├── put-…                    a small blob being stored whole (PutBlob)
//	│   └── ingest-…                 a blob being imported whole (Ingest)
//	├── ingests/
//	│   └── batch-…                  an import in progress: the blobs it added, taken
//	│                                back at Open if it never ended (IngestBatch)
//	├── quarantine/
//	│   └── sha256-ab12…ef-<time>    a blob found damaged on disk, kept for a look
//	└── meta/                         Badger: tags, media types, sizes, last access,
//	                                  declared sizes, download progress
//
// A blob reaches blobs/ only by rename after its size and digest have been
// checked, so a file there is complete and correct when it arrives. What
// the disk does to it later is caught by a size check at every open, a
// digest check at every manifest read, and a background scrub (see
// damage.go): a damaged blob is quarantined and fetched again. Files in partial/
// are never served from cache: a reader of an in-flight blob goes through the
// Partial that owns it. A download's progress (the ranges written, the
// running hash) is checkpointed in Badger under partial/<digest>, so a
// restart, even after kill -9, resumes it; a partial file without such a
// record is removed at Open.
//
// Each byte of a partial file is written once: concurrent writers claim
// ranges before writing, and bytes written or claimed are not written again.
// The running hash covers only bytes recorded as written, and a checkpoint
// saves it with those ranges as one state. What a resumed download's saved
// hash covers is read back from the file and checked before commit.
//
// The package imports neither proxy nor upstream.
package storage
