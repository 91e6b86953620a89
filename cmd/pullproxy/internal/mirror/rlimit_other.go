//go:build !unix

package mirror

func defaultMaxClientConnections() int { return maxClientConnectionsCap }
