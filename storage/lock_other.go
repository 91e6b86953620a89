//go:build !unix

package storage

func inUse(string) bool { return false }
