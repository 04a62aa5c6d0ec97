"""What serving is, as data: serve playbooks and deployments, the containers a deployment wants
(argv, labels, hashes), its history, bench runs, the gateway's and Prometheus's configuration,
and the programs shipped to hosts (the all-reduce benchmark, the node guard). Pure: no hosts
touched."""
