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
//	│   └── sha256-ab12…ef           a blob being downloaded, written at its offsets
//	└── meta/                         Badger: tags, media types, sizes, last access
//
// A blob reaches blobs/ only by rename after its size and digest have been
// checked, so a file there is always complete and correct. Files in partial/
// are never served from cache: a reader of an in-flight blob goes through the
// Partial that owns it. A restart keeps both; partial files left by a crash
// are removed at Open until downloads can resume them.
//
// The package imports neither proxy nor upstream.
package storage
