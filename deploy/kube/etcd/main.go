// Command etcd: go.etcd.io/etcd/server/v3/etcdmain, the same entry point as upstream's etcd.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
