"""The lab engine: a stand-in for vLLM that behaves like vLLM wherever sparkprov touches it.

Run as ``python3 -m sparkprov.lab.engine serve MODEL [flags]`` (the lab image's ``vllm``
wrapper does exactly that). Standard library only, plus ``ray`` for tensor parallelism.
sparkprov's product code never imports this package.
"""
VERSION = "0.11.0"
