"""What serving is, as data: serve playbooks and deployments, the containers a deployment wants
(argv, labels, hashes), and the all-reduce benchmark shipped to hosts. Pure: no hosts touched."""
