"""SSH to the nodes: one verified connection per node, commands as channels on it.

``session``: what a command on a node looks like (``Session``, ``Connector``);
``route``: where ssh_config sends a host (``ssh -G``), jump hosts included;
``trust``: host keys (known_hosts, accept-new pins); ``identity``: keys and ssh-agent;
``connect``: the connector (keepalive, shared jump hosts); ``channels``: commands on one
connection within sshd's MaxSessions; ``pool``: one session per node kept open across
operations, reconnected with backoff; ``preflight``: local mistakes found before connecting.
"""
