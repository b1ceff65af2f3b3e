"""Benchmarks for s3ckpt: throughput, stall and memory against a raw aiobotocore ceiling.

Run ``python -m benchmarks.bench_core`` (``make bench``); see that module for the options.
"""
