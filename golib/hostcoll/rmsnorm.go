package hostcoll

import (
	"github.com/p2pcomm/p2pcomm/golib/collective"
	"github.com/p2pcomm/p2pcomm/golib/reduce"
)

var _ collective.RMSNormer = (*Comm)(nil)

// AllReduceRMSNorm runs a fused all-reduce + residual add + RMSNorm
// (collective.RMSNorm) on the host: the all-reduce (sum) of X into Normed,
// then, row by row, ResidualOut and Normed from it (reduce.ResidualRMSNorm).
// The sum is this backend's all-reduce, bit for bit. Collective: a rank
// whose request is invalid (or carries Reject) takes part in the all-reduce
// with its error, so that its peers return MismatchError, and returns it.
// Ranks that agree on the element count and dtype but not on the row
// length are not told apart.
func (c *Comm) AllReduceRMSNorm(req collective.RMSNorm) error {
	why := req.Reject
	if why == nil {
		why = req.Validate()
	}
	ar := collective.AllReduce{Src: req.X, Dst: req.Normed, DType: req.DType, Op: reduce.Sum, Algo: req.Algo,
		Reject: why}
	if why == nil {
		ar.Count = req.Count()
	}
	if err := c.AllReduce(ar); err != nil {
		return err
	}
	reduce.ResidualRMSNorm(hostPtr(req.Normed), hostPtr(req.ResidualOut), hostPtr(req.Normed), hostPtr(req.Residual),
		hostPtr(req.Weight), int(req.Rows), int(req.Hidden), req.DType == reduce.BFloat16, req.Eps)
	return nil
}
