"""sparkprov: idempotent provisioning for NVIDIA DGX Spark fleets."""
__version__ = "0.1.0"
