"""The commands that touch hosts, as playbooks built in code and run on the engine. The CLI
(sparkprov/cli) parses options and prints what these return.

    book.py      building plays and tasks in code; running a book (what every command shares)
    serve.py     the books of cluster-up, cluster-down, status, nccl-check, gateway and bench
    cluster.py   cluster-up, cluster-down, status and nccl-check as the commands run them
    upgrade.py   cluster-up's history records and rollbacks; history and rollback
    replace.py   cluster-up --replace: the deployments it makes room on, brought back on a failure
    stage.py     stage-weights (the weights_* modules)
    store.py     store (list, prune, verify)
    gateway.py   gateway up|down, and the refresh cluster-up and cluster-down run after a change
    monitor.py   monitor write|up|down
    bench.py     bench: the play, then each run stored, plotted and compared
    guard.py     guard: the node guards as the status play reads them
    facts.py     facts: the host profile gathered
    fleet.py     the status play for commands that act on every deployment (gateway, monitor)
    images.py    images --host: the digests and options of the catalog's images on a host
    options.py   cluster-up's options (UpOptions): one object from the command line to the plays

provision and `invoke play` run YAML playbooks on the same engine.
"""
