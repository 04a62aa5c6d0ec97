"""Staging model weights into the model store of every serving host (`invoke stage-weights MODEL`).

    hub.py       what the hub has: revision -> commit, files with size, git oid and LFS sha256
                 (read from the control machine with huggingface_hub's HfApi)
    facts.py     what each host has: one remote call reads the store (sizes, mtimes, symlinks,
                 staged partial files, the recorded verified state, free space, tools)
    plan.py      pure: per host and file, ok / unverified / staged / partial / missing / wrong,
                 the bytes to move, the disk check, who sends what to whom
    fetch.py     the program that downloads on the source host, inside the serving image, with
                 huggingface_hub's own downloader (http_get), resuming partial files across runs
    verify.py    shell: hash files on a host, publish good ones atomically, record verified state
    fanout.py    which way a sender reaches a receiver, and the pipelined send that runs beside
                 the download on the source (each verified file streamed to the hosts that need it)
    store.py     the store as `invoke store` shows it (what each hub repo holds, verified or not)
                 and what pruning removes

The run itself (gather, verify, download once, fan out, publish) is plays on the engine:
sparkprov/plays/stage.py builds them, the modules are sparkprov/modules/weights_*.py, and the
engine's report shows each step as it ends.

Layout on every host (STORE = the inventory's model_store, HF_HOME for vLLM):

    STORE/hub/models--ORG--NAME/{blobs,snapshots/COMMIT,refs}   huggingface_hub's cache layout
    STORE/.sparkprov/staging/<same relative path>               partial and unverified files
    STORE/.sparkprov/verified                                   size, mtime, digest, path per line

A file reaches blobs/ (or its plain destination) only by rename(2) from staging/ after its digest
matched the hub's; the snapshot symlink is made after that, so nothing partial or unverified is
ever visible under snapshots/.
"""
