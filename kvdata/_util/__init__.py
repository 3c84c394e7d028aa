"""Small leaf utilities any layer may import: sizes, fsync'ed file writes, progress bars, libc."""
