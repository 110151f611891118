"""Mobius offload planning: profiles, partition MIP, cross mapping, pipeline simulator.

    profile    per-layer time/bytes profiles and the server's GPUs, memory and PCIe links
    partition  the mixed-integer program: number of stages and contiguous layer-to-stage cuts
    mapping    cross mapping: stage positions onto GPUs with least root-complex contention; stream priority
    measure    profiles and host-to-device bandwidth measured on the target device; hardware from the inventory
    simulate   discrete-event simulation of Mobius (cross/sequential), the offload data-parallel baseline, GPipe
    plan       the offload plan the planner offers when no GPU-resident plan fits
"""
