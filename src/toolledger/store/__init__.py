"""toolledger.store"""
