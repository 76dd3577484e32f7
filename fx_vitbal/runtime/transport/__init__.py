"""Rows on the wire: the routing of one call's plan and its host state, the moves and their
exchanges, the ``vitbal::redistribute`` / ``vitbal::restore`` ops, status words, output layouts,
the one seam of collectives, host/device transfers, rows in merge blocks. Imports no other room.
"""
