//go:build !linux

package storage

import (
	"errors"
	"os"
)

// Elsewhere every checkpoint is durable: no boot is known, so a progress
// attribute would never be trusted.

func bootID() string { return "" }

func setProgress(*os.File, []byte) error { return errors.ErrUnsupported }

func getProgress(*os.File) ([]byte, error) { return nil, nil }

func clearProgress(*os.File) error { return nil }
