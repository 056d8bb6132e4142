"""bucketfs: mount an object-storage bucket prefix read-only as a fast local directory."""

__version__ = "0.1.0"
