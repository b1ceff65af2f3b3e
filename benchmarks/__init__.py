"""Benchmarks for s3ckpt: throughput, stall and memory against a raw aiobotocore ceiling.

Run ``python -m benchmarks.bench_core`` (``make bench``); every benchmark's ``--help`` lists its
options, the shared ones defined once in `benchmarks.options`.
"""
