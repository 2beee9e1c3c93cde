package collective

import (
	"math"
	"testing"

	"github.com/p2pcomm/p2pcomm/golib/reduce"
	"github.com/p2pcomm/p2pcomm/golib/status"
)

func TestRMSNormValidate(t *testing.T) {
	good := RMSNorm{X: 1, Residual: 2, Weight: 3, Normed: 4, ResidualOut: 2, Rows: 7, Hidden: 4096,
		DType: reduce.BFloat16, Eps: 1e-6}
	tests := []struct {
		name string
		edit func(*RMSNorm)
		want status.Code
	}{
		{"good", func(*RMSNorm) {}, status.OK},
		{"float16, largest row", func(r *RMSNorm) { r.DType, r.Hidden = reduce.Float16, RMSNormMaxHidden }, status.OK},
		{"no rows, no tensors", func(r *RMSNorm) { *r = RMSNorm{Hidden: 8, DType: reduce.Float16} }, status.OK},
		{"twoshot", func(r *RMSNorm) { r.Algo = TwoShot }, status.OK},
		{"float32", func(r *RMSNorm) { r.DType = reduce.Float32 }, status.Unsupported},
		{"unknown dtype", func(r *RMSNorm) { r.DType = 99 }, status.Unsupported},
		{"row too long", func(r *RMSNorm) { r.Hidden = RMSNormMaxHidden + 8 }, status.Unsupported},
		{"row of no elements", func(r *RMSNorm) { r.Hidden = 0 }, status.Unsupported},
		{"row not whole packs", func(r *RMSNorm) { r.Hidden = 4100 }, status.Unsupported},
		{"negative rows", func(r *RMSNorm) { r.Rows = -1 }, status.InvalidArgument},
		{"overflow", func(r *RMSNorm) { r.Rows = math.MaxInt64 / 1024 }, status.InvalidArgument},
		{"negative eps", func(r *RMSNorm) { r.Eps = -1e-6 }, status.InvalidArgument},
		{"NaN eps", func(r *RMSNorm) { r.Eps = float32(math.NaN()) }, status.InvalidArgument},
		{"infinite eps", func(r *RMSNorm) { r.Eps = float32(math.Inf(1)) }, status.InvalidArgument},
		{"ring", func(r *RMSNorm) { r.Algo = Ring }, status.Unsupported},
		{"null weight", func(r *RMSNorm) { r.Weight = 0 }, status.InvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := good
			tt.edit(&r)
			if got := status.CodeOf(r.Validate()); got != tt.want {
				t.Errorf("%+v.Validate() = %v (%v), want %v", r, got, r.Validate(), tt.want)
			}
		})
	}
}
