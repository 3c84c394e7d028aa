"""Importers: existing data (image folders, Caffe list files and LMDBs) into kvdata datasets.

Each writes through `kvdata.open(path, "a")`, all or nothing.
"""
