package plan

import "time"

const (
	// MinChunkTarget is the least chunk target, and the target while a
	// source's pace is unknown: a fast path delivers it in milliseconds,
	// and a client reading in order sees the blob stream in steadily.
	MinChunkTarget = 1 << 20
	// MaxChunkTarget and ChunkPace: on a short path a chunk is what a
	// connection brings in ChunkPace, up to MaxChunkTarget, so that the
	// bytes in flight stay near the rate times ChunkPace. A long path's
	// many connections keep MinChunkTarget: with larger chunks there, the
	// last chunks of its connections end together, and a client reading
	// in order gets them all at once, after the upstream's last byte.
	MaxChunkTarget = 4 << 20
	ChunkPace      = 250 * time.Millisecond
	// MinChunk: a connection with less budget left than this is retired
	// rather than asked for a short chunk, which would cost a round trip of
	// its own for little; a gap's rest shorter than this joins the chunk
	// before it.
	MinChunk = MinChunkTarget / 2
	// SeveralChunks is the least budget that carries several chunks.
	SeveralChunks = 2 * MinChunkTarget
)

// Target is the chunk size for a connection that brings rate bytes a second
// (0: unknown, or a path where chunks stay small): what it brings in
// ChunkPace, in whole 64 KiB, within [MinChunkTarget, MaxChunkTarget].
func Target(rate float64) int64 {
	if rate <= 0 {
		return MinChunkTarget
	}
	n := int64(rate*ChunkPace.Seconds()) &^ (64<<10 - 1)
	return min(max(n, MinChunkTarget), MaxChunkTarget)
}

// ChunkSize is the chunk to ask for on a connection with left bytes of
// budget: all of it when that is not much more than target (a remainder
// too small for a chunk of its own goes with this one), else target. The
// budget caps every chunk: no session is asked to go past it.
func ChunkSize(left, target int64) int64 {
	if left <= target+MinChunk {
		return left
	}
	return target
}
