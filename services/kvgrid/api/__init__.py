"""Wire contract (generated code in ``v1``) and channels to kvgrid's services for other programs
(:mod:`kvgrid.api.client`: routers and tools calling the controller, with mTLS)."""
