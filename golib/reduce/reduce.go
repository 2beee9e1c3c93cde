// Package reduce names the element types and reduction operators that
// p2pcomm understands, and reduces host memory with them.
package reduce

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/status"
)

// DType is an element type. The numbers are part of the C ABI.
type DType int32

const (
	Float32   DType = 0
	Float64   DType = 1
	Float16   DType = 2
	BFloat16  DType = 3
	Int32     DType = 4
	Int64     DType = 5
	numDTypes       = 6
)

var dtypeInfo = [numDTypes]struct {
	name string
	size int
}{
	{"float32", 4}, {"float64", 8}, {"float16", 2}, {"bfloat16", 2}, {"int32", 4}, {"int64", 8},
}

// Valid reports whether d is a known dtype.
func (d DType) Valid() bool { return d >= 0 && d < numDTypes }

// Size is the element size in bytes.
func (d DType) Size() int { return dtypeInfo[d].size }

func (d DType) String() string {
	if !d.Valid() {
		return fmt.Sprintf("dtype(%d)", int32(d))
	}
	return dtypeInfo[d].name
}

// IsFloat reports whether d is a floating-point type.
func (d DType) IsFloat() bool { return d <= BFloat16 }

// Op is a reduction operator. The numbers are part of the C ABI.
type Op int32

const (
	Sum    Op = 0
	Prod   Op = 1
	Min    Op = 2
	Max    Op = 3
	Avg    Op = 4
	numOps    = 5
)

var opNames = [numOps]string{"sum", "prod", "min", "max", "avg"}

// Valid reports whether o is a known operator.
func (o Op) Valid() bool { return o >= 0 && o < numOps }

func (o Op) String() string {
	if !o.Valid() {
		return fmt.Sprintf("op(%d)", int32(o))
	}
	return opNames[o]
}

// Check returns a status error if dtype or op is unknown.
func Check(d DType, o Op) error {
	if !d.Valid() {
		return status.Errorf(status.Unsupported, "unsupported dtype code %d", int32(d))
	}
	if !o.Valid() {
		return status.Errorf(status.Unsupported, "unsupported reduce op code %d", int32(o))
	}
	return nil
}
