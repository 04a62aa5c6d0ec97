"""The commands that touch hosts, as playbooks built in code and run on the engine.

    book.py     building plays and tasks in code; running a book (what every command shares)
    serve.py    cluster-up, cluster-down, status, nccl-check (the serving modules)
    stage.py    stage-weights (the weights_* modules)

provision and `invoke play` run YAML playbooks on the same engine.
"""
