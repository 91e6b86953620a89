//go:build !unix

package main

func defaultMaxClientConnections() int { return maxClientConnectionsCap }
