"""State document, pure lease transitions and checkpoint stores."""
