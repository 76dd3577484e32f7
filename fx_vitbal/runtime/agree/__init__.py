"""Once per step, what every rank agrees on: the metadata gather and its checks, the messages of
bad input, the ``vitbal::plan`` op, replica sets, plans made ahead handed over. Imports the
rooms below it.
"""
