"""One rank's communicator: :class:`lab.comm.mesh.Mesh` and its parts (point-to-point, the
exchange algorithms run on, its books, channels, membership), the issue order and ``Work``, the
bootstrap under a launcher, planned runs of compiled collectives.

Above the transports, the compiled plane and the hosts; knows no algorithm. Empty on purpose.
"""
