"""Cluster presets, written as cluster.yaml text (parsed like a user's file)."""

CLUSTER_PRESETS: dict[str, str] = {
    # Four consumer desktops, each an RTX 4090 + i9-13900K with 64 GiB DDR5 (the rtx4090-64g
    # node), on one 10 GbE switch: about 9.4 Gbit/s achieved per TCP stream, ~50 us a message
    # through the kernel's network stack (the Prima.cpp / exo / distributed-llama home cluster).
    "4xdesktop-10gbe": """
name: 4xdesktop-10gbe
nodes: [rtx4090-64g, rtx4090-64g, rtx4090-64g, rtx4090-64g]
network: {bandwidth: 9.4Gbit/s, latency: 50us}
""",
}
