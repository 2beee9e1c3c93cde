package moe

import "unsafe"

// Limits and layouts shared with native/kernels/moe_common.cuh (and
// p2p_common.cuh); layout_test.go checks every one against the CUDA source.
const (
	maxRanks      = 8    // kMaxRanks: the size of every peer table
	maxTopK       = 32   // kMoeMaxTopK: one warp lane per k
	maxExperts    = 4096 // the send kernel's per-expert counters (owner_of is exact up to here)
	threads       = 512  // kThreads: every MoE kernel's block
	maxSyncBlocks = 256  // kMoeSyncBlocks: most blocks of a send kernel
	syncKinds     = 2    // kMoeKinds: dispatch, combine
	// syncFlagWords is kMoeFlagWords: start and staged flags
	// [kind][2][rank], then middle flags [kind][rank][block].
	syncFlagWords  = syncKinds*2*maxRanks + syncKinds*maxRanks*maxSyncBlocks
	syncStateBytes = 2112 // sizeof(MoeSyncState)
	syncGridShift  = 8    // kSyncGridShift: mode >> it is the send kernel's grid
	combWide       = 8    // kCombWide: most valid pairs of a token moe_combine_reduce_self sums itself
	sendSharedMax  = 48 << 10
)

// Sync mode bits (kSync* in moe_common.cuh): which in-kernel barrier steps a
// kernel runs.
const (
	syncStart       = 1  // send kernels: the start barrier
	syncArrive      = 2  // send kernels: every block posts its middle flags
	syncWait        = 4  // expand, reduce: wait for every peer's middle flags
	syncStageGo     = 16 // dispatch send: release the side stream's copy of x once past the start barrier
	syncStaged      = 32 // expand: wait for every peer's staged flag too
	syncPostStaged  = 64 // dispatch send: nothing to copy, post the staged flags at once
	kindDispatch    = 0
	kindCombine     = 1
	checkInvalidArg = 1 // the code moe_post_status posts for an expert id outside [-1, E) (status.InvalidArgument)
	// Status words: code | tag << statusTagShift (kStatusTagShift), tags
	// in [1, statusTagMax].
	statusTagShift = 8
	statusTagMax   = 1<<(32-statusTagShift) - 1
)

// syncParams mirrors MoeSync.
type syncParams struct {
	PeerFlags [maxRanks]uint64 `c:"peer_flags"`
	State     uint64           `c:"state"`
	Signal    uint64           `c:"signal"`
	Err       uint64           `c:"err"`
	TimeoutNs uint64           `c:"timeout_ns"`
	Mode      int32            `c:"mode"`
	Kind      int32            `c:"kind"`
}

// dispatchParams mirrors MoeDispatchParams.
type dispatchParams struct {
	PeerMeta   [maxRanks]uint64 `c:"peer_meta"`
	PeerHdr    [maxRanks]uint64 `c:"peer_hdr"`
	TopkIdx    uint64           `c:"topk_idx"`
	TopkW      uint64           `c:"topk_w"`
	SendSlot   uint64           `c:"send_slot"`
	PairRank   uint64           `c:"pair_rank"`
	NumTokens  int32            `c:"num_tokens"`
	MaxTokens  int32            `c:"max_tokens"`
	Hidden     int32            `c:"hidden"`
	TopK       int32            `c:"topk"`
	NumExperts int32            `c:"num_experts"`
	Rank       int32            `c:"rank"`
	World      int32            `c:"world"`
	IdxBytes   int32            `c:"idx_bytes"`
	Counted    int32            `c:"counted"`
	IDsShared  int32            `c:"ids_shared"`
	Status     uint64           `c:"status"`
	Sync       syncParams       `c:"sync"`
	StageSrc   uint64           `c:"stage_src"`
	StageDst   uint64           `c:"stage_dst"`
	CountsHost uint64           `c:"counts_host"`
}

// expandParams mirrors MoeExpandParams.
type expandParams struct {
	PeerXs       [maxRanks]uint64 `c:"peer_xs"`
	Meta         uint64           `c:"meta"`
	Hdr          uint64           `c:"hdr"`
	OutX         uint64           `c:"out_x"`
	OutInfo      uint64           `c:"out_info"`
	ExpertCounts uint64           `c:"expert_counts"`
	CombRows     uint64           `c:"comb_rows"`
	RowCap       int64            `c:"row_cap"`
	MaxTokens    int32            `c:"max_tokens"`
	RowBytes     int32            `c:"row_bytes"`
	TopK         int32            `c:"topk"`
	NumLocal     int32            `c:"num_local"`
	World        int32            `c:"world"`
	Rank         int32            `c:"rank"`
	Sync         syncParams       `c:"sync"`
	OutScales    uint64           `c:"out_scales"`
	XsScales     int64            `c:"xs_scales"`
	ScaleBytes   int32            `c:"scale_bytes"`
	Pad          int32            `c:"pad"`
}

// combineParams mirrors MoeCombineParams.
type combineParams struct {
	PeerComb  [maxRanks]uint64 `c:"peer_comb"`
	ExpertOut uint64           `c:"expert_out"`
	Meta      uint64           `c:"meta"`
	Hdr       uint64           `c:"hdr"`
	CombRows  uint64           `c:"comb_rows"`
	SendSlot  uint64           `c:"send_slot"`
	Y         uint64           `c:"y"`
	RowCap    int64            `c:"row_cap"`
	NumTokens int32            `c:"num_tokens"`
	MaxTokens int32            `c:"max_tokens"`
	Hidden    int32            `c:"hidden"`
	TopK      int32            `c:"topk"`
	Rank      int32            `c:"rank"`
	World     int32            `c:"world"`
	NumLocal  int32            `c:"num_local"`
	SelfLocal int32            `c:"self_local"`
	Status    uint64           `c:"status"`
	Sync      syncParams       `c:"sync"`
}

// postParams mirrors MoePostParams.
type postParams struct {
	PeerStatus [maxRanks]uint64 `c:"peer_status"`
	TopkIdx    uint64           `c:"topk_idx"`
	NumIDs     int32            `c:"num_ids"`
	NumExperts int32            `c:"num_experts"`
	IdxBytes   int32            `c:"idx_bytes"`
	Code       int32            `c:"code"`
	IDCode     int32            `c:"id_code"`
	Rank       int32            `c:"rank"`
	World      int32            `c:"world"`
	Tag        int32            `c:"tag"`
	Signal     uint64           `c:"signal"`
	Err        uint64           `c:"err"`
	TimeoutNs  uint64           `c:"timeout_ns"`
	HostStatus uint64           `c:"host_status"`
	Kind       int32            `c:"kind"`
	Pad        int32            `c:"pad"`
}

// stagedParams mirrors MoeStagedParams.
type stagedParams struct {
	Src      uint64 `c:"src"`
	Dst      uint64 `c:"dst"`
	Index    uint64 `c:"index"`
	Weights  uint64 `c:"weights"`
	Items    int64  `c:"items"`
	RowPacks int32  `c:"row_packs"`
	TopK     int32  `c:"topk"`
	ItemsAt  uint64 `c:"items_at"` // when set, the item count (at most Items) in mapped host memory
}

// paramBytes is the bytes of a parameter struct, for a launch (the driver
// copies them before the launch returns). The structs hold no Go pointers.
func paramBytes[T dispatchParams | expandParams | combineParams | postParams | stagedParams](p *T) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(p)), unsafe.Sizeof(*p))
}
