// Command etcd is etcd's own server (go.etcd.io/etcd/server/v3, pinned in ../../go.mod),
// the storage under the tests' kube-apiserver.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
