package bootstrap_test

import (
	"fmt"

	"github.com/p2pcomm/p2pcomm/golib/bootstrap"
)

func ExampleTCPConfigFromEnv() {
	// What torchrun sets for rank 1 of 2; usually pass os.LookupEnv.
	env := map[string]string{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node-0", "MASTER_PORT": "29500"}
	cfg, err := bootstrap.TCPConfigFromEnv(func(k string) (string, bool) { v, ok := env[k]; return v, ok })
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("rank %d of %d dials %s:%d, timeout %v\n", cfg.Rank, cfg.Size, cfg.Addr, cfg.Port, cfg.Timeout)
	// Output: rank 1 of 2 dials node-0:29501, timeout 2m0s
}

func ExampleNewCallback() {
	// A job of one: the fixed-size all-gather just copies. From Python the
	// callback wraps torch.distributed.all_gather_into_tensor.
	allGather := func(send, recv []byte) error { copy(recv, send); return nil }
	b, err := bootstrap.NewCallback(0, 1, allGather, nil)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer b.Close()
	got, err := b.AllGather([]byte("ipc handle"))
	fmt.Printf("%q %v\n", got, err)
	// Output: ["ipc handle"] <nil>
}
