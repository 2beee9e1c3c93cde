//go:build race

package hostcoll

const raceEnabled = true
